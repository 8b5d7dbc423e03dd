"""`ddpq up` is ready when its worker is: /readyz waits for the worker the deployment starts
itself (``Settings.expect_worker``); a starting worker is not "no worker". The real ``ddpq up``
is in tests/e2e/test_worker_up.py."""

from __future__ import annotations

from fastapi.testclient import TestClient

from service.app import create_app
from service.core.config import Settings
from service.core.wire import API_PREFIX
from service.store.db import Database
from service.store.workers import registry

API = API_PREFIX
SPEC = {
    "name": "right-after-up",
    "task": "regression",
    "resources": {"nproc_per_node": 1},
    "training": {"max_steps": 1},
}


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
