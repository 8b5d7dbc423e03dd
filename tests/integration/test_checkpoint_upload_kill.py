"""The API process SIGKILLed in the middle of a chunk and started again (a real uvicorn
process, SQLite and PostgreSQL, both stores): the upload resumes from ``GET status`` and
commits; nothing partial is ever listed or downloadable."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.core.config import Settings
from service.core.wire import attempt as wire
from service.store.db import Database
from tests.uploads import API, begin, commit, mint, put_chunk, running_job, send_rest, sha, status

CHUNK = 64 * 1024
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_api(settings: Settings, port: int, store: str, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "DDPQ_HOME": str(settings.home),
        "DDPQ_DATABASE_URL": settings.resolved_database_url,
        "DDPQ_ARTIFACT_DIR": str(settings.resolved_artifact_dir),
        "DDPQ_AUTH": "off",
        "DDPQ_CHECKPOINT_STORE": store,
        "DDPQ_CHECKPOINT_CHUNK_BYTES": str(CHUNK),
    }
    cmd = [sys.executable, "-m", "uvicorn", "service.app:create_app", "--factory",
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]  # fmt: skip
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the API exited with {proc.returncode}: {log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the API did not start in 60 s: {log.read_text()}")


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("store", ["filesystem", "database"])
def test_an_upload_survives_an_api_killed_mid_chunk(
    settings: Settings,
    db: Database,
    tmp_path: Path,
    port: int,
    procs: list[subprocess.Popen[bytes]],
    store: str,
) -> None:
    job_id = running_job(db)
    rank = mint(db, job_id)
    data = os.urandom(4 * CHUNK + 123)
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "api.log"
    procs.append(start_api(settings, port, store, log))
    with httpx.Client(base_url=url, timeout=30) as api:
        uid = begin(api, rank, data, step=50).json()["upload_id"]
        for offset in (0, CHUNK):
            assert (
                put_chunk(api, rank, uid, offset, data[offset : offset + CHUNK]).status_code == 200
            )

    # The third chunk: half of it sent, then the API process is killed.
    half_sent, release = threading.Event(), threading.Event()
    third = data[2 * CHUNK : 3 * CHUNK]
    outcome: list[object] = []

    def body() -> Iterator[bytes]:
        yield third[: CHUNK // 2]
        half_sent.set()
        release.wait(30)
        yield third[CHUNK // 2 :]

    def send() -> None:
        headers = {**rank, wire.CHUNK_SHA256_HEADER: sha(third)}
        path = API + wire.UPLOAD_CHUNK_PATH.format(upload_id=uid)
        try:
            r = httpx.put(url + path, params={"offset": 2 * CHUNK}, content=body(),
                          headers=headers, timeout=30)  # fmt: skip
            outcome.append(r.status_code)
        except httpx.TransportError as exc:
            outcome.append(exc)

    sender = threading.Thread(target=send)
    sender.start()
    assert half_sent.wait(30)
    time.sleep(0.3)  # the half chunk reaches the server
    os.kill(procs[0].pid, signal.SIGKILL)
    procs[0].wait(10)
    release.set()
    sender.join(30)
    assert outcome and not isinstance(outcome[0], int), f"the chunk cannot have landed: {outcome}"

    procs.append(start_api(settings, port, store, log))
    with httpx.Client(base_url=url, timeout=30) as api:
        assert api.get(f"{API}/jobs/{job_id}/checkpoints").json() == {"checkpoints": []}
        assert api.get(f"{API}/jobs/{job_id}/checkpoints/50/file").status_code == 404
        r = status(api, rank, uid)
        assert r.status_code == 200, r.text
        assert r.json()["received_bytes"] == 2 * CHUNK, "resume after the last whole chunk"
        send_rest(api, rank, uid, data, CHUNK)
        r = commit(api, rank, uid)
        assert r.status_code == 201, r.text
        assert [
            c["step"] for c in api.get(f"{API}/jobs/{job_id}/checkpoints").json()["checkpoints"]
        ] == [50]
        r = api.get(f"{API}/jobs/{job_id}/checkpoints/50/file")
        assert r.content == data and r.headers[wire.SHA256_HEADER] == sha(data)
