"""Helpers for tests of a resumed job over the real app (``TestClient``): claim, requeue, post
points and timelines with attempt tokens, and a job that resumed from step 4 after step 7."""

from __future__ import annotations

import time
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select

from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.core.wire import attempt as wire
from service.store.attempts.tokens import mint_attempt_token
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs import crud as jobs
from service.store.models import Metric
from service.store.workers import registry as workers

API = API_PREFIX
SPEC: dict[str, Any] = {"name": "reg", "task": "regression", "max_restarts": 3}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def claim(db: Database, job_id: int) -> str:
    """Claim the queued job (its next attempt), move it to running, mint its token."""
    with db.session() as s:
        workers.register_worker(s, worker_id="w", host="h", pid=1, launcher="local", capacity={})
    with db.session() as s:
        job = claims.claim_next_job(
            s, worker_id="w", launcher="local", max_gpus_per_node=0, lease_s=300
        )
        assert job is not None and job.id == job_id
        jobs.apply_transition(s, jobs.Transition(job_id, JobState.STARTING, JobState.RUNNING))
        return mint_attempt_token(s, job_id, job.attempt)


def requeue(db: Database, job_id: int) -> None:
    with db.session() as s:
        t = jobs.Transition(job_id, JobState.RUNNING, JobState.QUEUED, "worker lost: test")
        jobs.apply_transition(s, t)


def post_points(
    api: TestClient, token: str, steps: range, value: float, ranks: int | None = 2
) -> Any:
    """One batch of ``loss`` points (``value + step`` each, 4 steps per epoch), stamped 2 ms
    apart so that every step has its own moment."""
    rows: list[list[Any]] = []
    for step in steps:
        time.sleep(0.002)
        row: list[Any] = ["loss", step, (step - 1) // 4, value + step, time.time()]
        if ranks is not None:
            row.append(ranks)
        rows.append(row)
    r = api.post(API + wire.METRICS_PATH, json={"points": rows}, headers=bearer(token))
    assert r.status_code == 200, r.text
    return r.json()


def timeline(api: TestClient, token: str, **body: Any) -> int:
    return api.post(API + wire.TIMELINE_PATH, json=body, headers=bearer(token)).status_code


def current(db: Database, job_id: int) -> list[tuple[int, int, float]]:
    with db.session(write=False) as s:
        rows = s.execute(
            select(Metric.step, Metric.attempt, Metric.value)
            .where(Metric.job_id == job_id, Metric.name == "loss")
            .order_by(Metric.step)
        ).all()
    return [(r.step, r.attempt, r.value) for r in rows]


def resumed_job(api: TestClient, db: Database, users: dict[str, dict[str, str]]) -> int:
    """Attempt 1 stores steps 1-7 (100 + step), is lost, attempt 2 resumes from step 4 and
    stores steps 5-12 (200 + step), step 12 as rank 0's own value."""
    r = api.post(f"{API}/jobs", json=SPEC, headers=users["alice"])
    job_id = int(r.json()["id"])
    first = claim(db, job_id)
    assert timeline(api, first, resume_step=0, restore_s=0.0) == 204
    post_points(api, first, range(1, 8), 100.0)
    requeue(db, job_id)
    second = claim(db, job_id)
    assert timeline(api, first, resume_step=4) == 409, "attempt 1's token is fenced off"
    assert timeline(api, second, resume_step=4, restore_s=0.5) == 204
    post_points(api, second, range(5, 12), 200.0)
    post_points(api, second, range(12, 13), 200.0, ranks=0)
    return job_id
