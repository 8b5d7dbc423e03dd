"""`ddpq up` is ready when its worker is: /readyz waits for the worker the deployment starts
itself (``Settings.expect_worker``), and a job submitted once it answers finds that worker."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from fastapi.testclient import TestClient

from service.app import create_app
from service.core.config import Settings
from service.store.db import Database
from service.store.workers import registry

API = "/api/v1"
SPEC = {
    "name": "right-after-up",
    "task": "regression",
    "resources": {"nproc_per_node": 1},
    "training": {"max_steps": 1},
}
RUN_UP = (
    "from service.core.config import Settings; from worker.up import run_up; run_up(Settings())"
)
NO_WORKER = "no worker of launcher local is registered"


def test_readyz_waits_for_the_expected_worker(settings: Settings, db: Database) -> None:
    up_like = settings.model_copy(update={"expect_worker": "local", "slurm_enabled": True})
    with TestClient(create_app(up_like)) as api:
        r = api.get("/readyz")
        assert r.status_code == 503, r.text
        assert r.json()["detail"] == "waiting for the local worker to register"
        # The worker is starting: a submit meanwhile does not say there is none.
        job = api.post(f"{API}/jobs", json=SPEC).json()
        assert job["warnings"] == []
        dry = api.post(f"{API}/jobs?dry_run=true", json=SPEC)
        assert dry.status_code == 200, dry.text
        assert dry.json()["warnings"] == []
        # Another launcher's worker is not the one it waits for.
        slurm = {**SPEC, "launcher": "slurm"}
        assert api.post(f"{API}/jobs", json=slurm).json()["warnings"] != []
        with db.session() as session:
            registry.register_worker(
                session, worker_id="w1", host="h", pid=1, launcher="local", capacity={"slots": 1}
            )
        assert api.get("/readyz").json() == {"status": "ok"}
        with db.session() as session:
            registry.stop_worker(session, "w1")
        assert api.get("/readyz").status_code == 503, "a stopped worker is not ready"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_submit_right_after_up_is_ready_finds_its_worker(tmp_path: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "DDPQ_HOME": str(tmp_path / ".ddpq"), "DDPQ_PORT": str(port)}
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        up = subprocess.Popen(
            [sys.executable, "-c", RUN_UP], env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            assert up.poll() is None, f"ddpq up exited early:\n{log_path.read_text()}"
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"/readyz never answered:\n{log_path.read_text()}"
            time.sleep(0.1)
        # As scripts/demo.sh does: submit the moment /readyz answers.
        r = httpx.post(f"{url}{API}/jobs", json=SPEC, timeout=10)
        assert r.status_code == 201, r.text
        assert not any(NO_WORKER in w for w in r.json()["warnings"]), r.json()["warnings"]
        httpx.post(f"{url}{API}/jobs/{r.json()['id']}/cancel", timeout=10)
        # The ready line comes once the worker has registered, too.
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
