"""Concurrent retry-failed and extend calls on one sweep, through the real app on SQLite and
PostgreSQL with real threads: each failed trial is re-queued exactly once, and parallel
extends add each new trial once with no 409."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import func, select

from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.store.db import Database
from service.store.jobs import crud as jobs
from service.store.models import Job, SweepTrial
from service.store.workers import registry as workers

API = API_PREFIX
N_CALLERS = 8
SWEEP: dict[str, Any] = {
    "name": "race",
    "base": {"name": "b", "task": "regression", "training": {"max_steps": 5}},
    "axes": {"training.lr": {"grid": [0.001, 0.01]}},
    "seeds": 2,
}


def fail_job(db: Database, job_id: int) -> None:
    """Drive one job queued → starting → running → failed through the store."""
    with db.session() as s:
        workers.register_worker(
            s, worker_id="w", host="h", pid=1, launcher="local", capacity={"slots": 100}
        )
        for a, b in (
            (JobState.QUEUED, JobState.STARTING),
            (JobState.STARTING, JobState.RUNNING),
            (JobState.RUNNING, JobState.FAILED),
        ):
            jobs.apply_transition(s, jobs.Transition(job_id, a, b, "test"))


def in_parallel(call: Callable[[], int]) -> list[int]:
    """Run ``call`` in ``N_CALLERS`` threads released together; their status codes."""
    start = threading.Barrier(N_CALLERS)
    codes: list[int] = []

    def one() -> None:
        start.wait()
        codes.append(call())

    threads = [threading.Thread(target=one) for _ in range(N_CALLERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return codes


def test_concurrent_retries_requeue_each_failed_trial_once(api: TestClient, db: Database) -> None:
    sweep = api.post(f"{API}/sweeps", json=SWEEP).json()
    rows = api.get(f"{API}/sweeps/{sweep['id']}/trials").json()["trials"]
    for row in rows:
        fail_job(db, row["job_id"])
    codes = in_parallel(lambda: api.post(f"{API}/sweeps/{sweep['id']}/retry-failed").status_code)
    assert codes == [200] * N_CALLERS
    with db.session(write=False) as s:
        n_jobs = s.scalar(select(func.count()).select_from(Job).where(Job.sweep_id == sweep["id"]))
        pointed = set(s.scalars(select(SweepTrial.job_id)))
        queued = set(s.scalars(select(Job.id).where(Job.state == JobState.QUEUED.value)))
    assert n_jobs == 2 * len(rows), "one new job per failed trial, however the calls interleave"
    assert queued == pointed, "every queued job is a trial's newest job: no orphans"


def test_concurrent_extends_add_each_new_trial_once(api: TestClient, db: Database) -> None:
    sweep = api.post(f"{API}/sweeps", json=SWEEP).json()
    body = {"axes": {"training.lr": {"grid": [0.1, 0.2]}}, "seeds": 3}
    codes = in_parallel(
        lambda: api.post(f"{API}/sweeps/{sweep['id']}/extend", json=body).status_code
    )
    assert codes == [200] * N_CALLERS, "no opaque 409 from a unique clash"
    with db.session(write=False) as s:
        keys = list(s.scalars(select(SweepTrial.trial_key)))
        n_jobs = s.scalar(select(func.count()).select_from(Job))
    assert len(keys) == len(set(keys)) == 4 * 3 and n_jobs == 12
