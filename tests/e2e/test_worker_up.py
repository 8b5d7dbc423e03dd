"""``ddpq up``: migrate + API + one worker that reaches the API over loopback with a worker
token it minted for itself; SIGTERM stops it all."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from service.core.config import Settings
from service.core.wire import API_PREFIX
from worker.errors import PortInUseError
from worker.up import run_up

RUN_UP = "import sys; from service.cli.main import main; sys.argv = ['ddpq', 'up']; main()"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _descendants(pid: int) -> set[int]:
    """All live descendants of ``pid`` (from /proc/<pid>/stat parent ids)."""
    parents: dict[int, int] = {}
    for entry in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        children = {c for c, p in parents.items() if p in frontier}
        frontier = children - found
        found |= children
    return found


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_up(tmp_path: Path) -> tuple[subprocess.Popen[bytes], str, Path]:
    """``ddpq up`` in its own session, once its /readyz answers 200: (process, base URL, log).
    The caller stops it (and SIGKILLs its process group if it must).

    Raises:
        AssertionError: it exited, or /readyz did not answer within 120 s (with its log).
    """
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "DDPQ_HOME": str(tmp_path / ".ddpq"), "DDPQ_PORT": str(port)}
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        up = subprocess.Popen(
            [sys.executable, "-c", RUN_UP], env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 120
    while True:
        if up.poll() is not None:
            raise AssertionError(f"ddpq up exited early:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return up, url, log_path
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
            raise AssertionError(f"/readyz never answered:\n{log_path.read_text()}")
        time.sleep(0.1)


def test_up_serves_then_stops_with_no_child_left(tmp_path: Path) -> None:
    up, url, log_path = start_up(tmp_path)
    try:
        output = log_path.read_text()
        deadline = time.monotonic() + 60
        while "ddpq is up" not in output and time.monotonic() < deadline:
            time.sleep(0.2)
            output = log_path.read_text()
        assert f"{url}/" in output, output
        # It names the database it serves, and that this one is new (a fresh DDPQ_HOME).
        db_file = (tmp_path / ".ddpq" / "ddpq.db").resolve()
        assert f"database: sqlite:///{db_file} (new, empty" in " ".join(output.split()), output
        children = _descendants(up.pid)
        assert len(children) >= 2, f"expected an API and a worker process, got {children}"
        worker = [pid for pid in children if b"worker.main" in _read(f"/proc/{pid}/cmdline")]
        assert worker, "no worker process"
        # The worker holds a worker token and the API's URL, never the database's.
        environ = _read(f"/proc/{worker[0]}/environ").split(b"\0")
        names = {line.split(b"=", 1)[0] for line in environ}
        assert b"DDPQ_WORKER_TOKEN" in names and b"DDPQ_DATABASE_URL" not in names
        assert not [line for line in environ if b"ddpq.db" in line or b"sqlite" in line]
        up.send_signal(signal.SIGTERM)
        assert up.wait(90) == 0, log_path.read_text()
        survivors = [pid for pid in children if _alive(pid)]
        assert survivors == [], f"children outlived ddpq up: {survivors}"
        assert "ddpq stopped." in log_path.read_text()
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


def test_up_refuses_a_taken_port(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = Settings(home=tmp_path / ".ddpq", port=port)
        with pytest.raises(PortInUseError, match=f"127.0.0.1:{port}.*another port"):
            run_up(settings, worker_token="ddpqw_unused", announce=lambda _line: None)


SPEC = {
    "name": "right-after-up",
    "task": "regression",
    "resources": {"nproc_per_node": 1},
    "training": {"max_steps": 1},
}
NO_WORKER = "no worker of launcher local is registered"


def test_a_submit_right_after_up_is_ready_finds_its_worker(tmp_path: Path) -> None:
    """As scripts/demo.sh does: submit the moment /readyz answers; no warning that no worker
    is registered, and the ready line comes after the worker registered."""
    up, url, log_path = start_up(tmp_path)
    try:
        r = httpx.post(f"{url}{API_PREFIX}/jobs", json=SPEC, timeout=10)
        assert r.status_code == 201, r.text
        assert not any(NO_WORKER in w for w in r.json()["warnings"]), r.json()["warnings"]
        httpx.post(f"{url}{API_PREFIX}/jobs/{r.json()['id']}/cancel", timeout=10)
        deadline = time.monotonic() + 30
        while "ddpq is up" not in log_path.read_text():
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        output = log_path.read_text()
        assert output.index("registered: launcher=local") < output.index("ddpq is up"), output
        up.send_signal(signal.SIGTERM)
        assert up.wait(90) == 0, log_path.read_text()
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
