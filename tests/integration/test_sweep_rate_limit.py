"""With auth on, every trial a sweep, an extend or a retry-failed stores counts as one job
against the owner's DDPQ_SUBMISSIONS_PER_MINUTE: 429 with Retry-After when they do not fit
the last minute, 422 when they never could, nothing stored either way (SQLite and
PostgreSQL)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from service.core.config import Settings
from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.store.auth.tokens import create_token
from service.store.db import Database
from service.store.jobs import crud as jobs
from service.store.models import Job
from service.store.workers import registry as workers

API = API_PREFIX
LIMIT = 5
BASE: dict[str, Any] = {"name": "b", "task": "regression", "training": {"max_steps": 5}}


def sweep_of(n: int) -> dict[str, Any]:
    return {"name": "s", "base": BASE, "axes": {"training.lr": {"grid": [0.001]}}, "seeds": n}


def bearer(db: Database, owner: str) -> dict[str, str]:
    with db.session() as s:
        return {"Authorization": f"Bearer {create_token(s, owner=owner)[1]}"}


def n_jobs(db: Database) -> int:
    with db.session(write=False) as s:
        return s.scalar(select(func.count()).select_from(Job)) or 0


def age_jobs(db: Database, seconds: float) -> None:
    with db.session() as s:
        for job in s.scalars(select(Job)):
            job.created_at -= timedelta(seconds=seconds)


@pytest.fixture
def app_settings(settings: Settings) -> Settings:
    """What this module's ``api`` serves (tests/conftest.py)."""
    return settings.model_copy(update={"auth": "on", "submissions_per_minute": LIMIT})


def test_a_sweeps_trials_count_against_the_limit(api: TestClient, db: Database) -> None:
    alice = bearer(db, "alice")
    assert api.post(f"{API}/sweeps", json=sweep_of(4), headers=alice).status_code == 201
    r = api.post(f"{API}/sweeps", json=sweep_of(2), headers=alice)
    assert r.status_code == 429 and 1 <= int(r.headers["Retry-After"]) <= 60, r.text
    assert n_jobs(db) == 4, "a refused sweep stores nothing"
    assert api.post(f"{API}/sweeps", json=sweep_of(1), headers=alice).status_code == 201
    bob = bearer(db, "bob")
    assert api.post(f"{API}/sweeps", json=sweep_of(5), headers=bob).status_code == 201


def test_a_sweep_larger_than_the_limit_is_422_saying_how(api: TestClient, db: Database) -> None:
    r = api.post(f"{API}/sweeps", json=sweep_of(LIMIT + 1), headers=bearer(db, "alice"))
    assert r.status_code == 422 and "DDPQ_SUBMISSIONS_PER_MINUTE" in r.text, r.text
    assert n_jobs(db) == 0


def test_extend_counts_its_new_trials(api: TestClient, db: Database) -> None:
    alice = bearer(db, "alice")
    sweep = api.post(f"{API}/sweeps", json=sweep_of(3), headers=alice).json()
    url = f"{API}/sweeps/{sweep['id']}/extend"
    r = api.post(url, json={"seeds": 6}, headers=alice)
    assert r.status_code == 429 and "Retry-After" in r.headers, r.text
    assert n_jobs(db) == 3
    r = api.post(url, json={"seeds": 1000}, headers=alice)
    assert r.status_code == 422 and n_jobs(db) == 3, r.text
    assert api.post(url, json={"seeds": 5}, headers=alice).json()["added"] == 2
    age_jobs(db, 61)
    assert api.post(url, json={"seeds": 8}, headers=alice).json()["added"] == 3
    other = api.post(url, json={"seeds": 9}, headers=bearer(db, "mallory"))
    assert other.status_code == 404 and n_jobs(db) == 8


def test_retry_failed_counts_its_new_jobs(api: TestClient, db: Database) -> None:
    alice = bearer(db, "alice")
    sweep = api.post(f"{API}/sweeps", json=sweep_of(3), headers=alice).json()
    with db.session() as s:
        workers.register_worker(
            s, worker_id="w", host="h", pid=1, launcher="local", capacity={"slots": 100}
        )
        for job_id in s.scalars(select(Job.id)).all():
            for a, b in (
                (JobState.QUEUED, JobState.STARTING),
                (JobState.STARTING, JobState.RUNNING),
                (JobState.RUNNING, JobState.FAILED),
            ):
                jobs.apply_transition(s, jobs.Transition(job_id, a, b, "test"))
    url = f"{API}/sweeps/{sweep['id']}/retry-failed"
    r = api.post(url, headers=alice)
    assert r.status_code == 429 and n_jobs(db) == 3, r.text
    age_jobs(db, 61)
    assert api.post(url, headers=alice).json()["added"] == 3
