"""The API reaps lost workers' jobs on its own (issue 6: "a reaper in workers and in the
API"): with no worker running, a job whose lease expired goes back to ``queued`` as the next
attempt, and a live lease is left alone."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

from service.app import create_app
from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.store import migrate
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs import crud as jobs
from service.store.workers import registry as workers


def _running_job(db: Database, lease_s: float) -> int:
    with db.session() as s:
        job, _ = jobs.submit_job(s, JobSpec(name="t", task="regression"), owner="local")
        workers.register_worker(s, worker_id="w1", host="h", pid=1, launcher="local", capacity={})
    with db.session() as s:
        claimed = claims.claim_next_job(
            s, worker_id="w1", launcher="local", max_gpus_per_node=0, lease_s=lease_s
        )
        assert claimed is not None and claimed.id == job.id
        jobs.apply_transition(s, jobs.Transition(job.id, JobState.STARTING, JobState.RUNNING))
    return job.id


def test_the_api_requeues_a_job_whose_lease_expired(settings: Settings, db: Database) -> None:
    migrate.upgrade(db.engine)
    lost = _running_job(db, lease_s=0.5)
    held = _running_job(db, lease_s=3600)
    fast = settings.model_copy(update={"heartbeat_interval_s": 0.2})
    with TestClient(create_app(fast)) as api:  # the lifespan runs the reaper; no worker runs
        deadline = time.monotonic() + 30
        while api.get(f"{API_PREFIX}/jobs/{lost}").json()["state"] != "queued":
            assert time.monotonic() < deadline, "the API never reaped the lost job"
            time.sleep(0.1)
        job = api.get(f"{API_PREFIX}/jobs/{lost}").json()
        assert job["attempt"] == 2
        events = api.get(f"{API_PREFIX}/jobs/{lost}/events").json()["events"]
        assert events[-1]["reason"] == "worker lost: lease expired"
        assert api.get(f"{API_PREFIX}/jobs/{held}").json()["state"] == "running", (
            "a live lease stays"
        )
