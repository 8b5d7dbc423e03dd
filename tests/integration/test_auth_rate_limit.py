"""Submissions per owner per minute: 429 with Retry-After, nothing stored, on SQLite and
PostgreSQL, also under concurrent submitters."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from service.app import create_app
from service.core.config import Settings
from service.core.spec.model import validate_spec
from service.core.wire import API_PREFIX
from service.store.auth.tokens import create_token
from service.store.db import Database
from service.store.jobs import crud as jobs
from service.store.jobs.rate_limits import RateLimitedError, check_submission_rate
from service.store.models import Job, utcnow

API = API_PREFIX
SPEC: dict[str, Any] = {"name": "reg", "task": "regression", "training": {"max_steps": 10}}
LIMIT = 3


def bearer(db: Database, owner: str) -> dict[str, str]:
    with db.session() as s:
        return {"Authorization": f"Bearer {create_token(s, owner=owner)[1]}"}


def job_count(db: Database) -> int:
    with db.session(write=False) as s:
        return len(jobs.list_jobs(s, limit=10_000)[0])


def age_jobs(db: Database, seconds: float) -> None:
    """Pretend every stored job was submitted ``seconds`` earlier than it was."""
    with db.session() as s:
        for job in s.scalars(select(Job)):
            job.created_at -= timedelta(seconds=seconds)


@pytest.fixture
def app_settings(settings: Settings) -> Settings:
    """What this module's ``api`` serves (tests/conftest.py)."""
    return settings.model_copy(update={"auth": "on", "submissions_per_minute": LIMIT})


def test_over_the_limit_is_429_with_retry_after_and_stores_nothing(
    api: TestClient, db: Database
) -> None:
    alice, bob = bearer(db, "alice"), bearer(db, "bob")
    for i in range(LIMIT):
        r = api.post(f"{API}/jobs", json=SPEC, headers={**alice, "Idempotency-Key": f"k{i}"})
        assert r.status_code == 201, r.text
    r = api.post(f"{API}/jobs", json=SPEC, headers=alice)
    assert r.status_code == 429, r.text
    retry_after = int(r.headers["retry-after"])
    assert 1 <= retry_after <= 60, retry_after
    assert "DDPQ_SUBMISSIONS_PER_MINUTE" in r.json()["detail"]
    assert job_count(db) == LIMIT, "a refused submission stores nothing"

    replay = api.post(f"{API}/jobs", json=SPEC, headers={**alice, "Idempotency-Key": "k0"})
    assert replay.status_code == 200, "a retried submission creates nothing, so it is not limited"
    assert api.post(f"{API}/jobs", json=SPEC, headers=bob).status_code == 201, "per owner"

    age_jobs(db, 50)  # alice's oldest counted job now leaves the window in ~10 s
    r = api.post(f"{API}/jobs", json=SPEC, headers=alice)
    assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 10, r.headers
    age_jobs(db, 11)
    assert api.post(f"{API}/jobs", json=SPEC, headers=alice).status_code == 201
    assert job_count(db) == LIMIT + 2


def test_with_auth_off_a_sweep_is_not_limited(settings: Settings, db: Database) -> None:
    """The embedded default (auth off, one owner: the operator) queues a sweep of jobs past
    the per-owner limit; the limit is for servers shared through tokens."""
    open_box = settings.model_copy(update={"auth": "off", "submissions_per_minute": LIMIT})
    with TestClient(create_app(open_box)) as client:
        codes = [client.post(f"{API}/jobs", json=SPEC).status_code for _ in range(LIMIT + 2)]
    assert codes == [201] * (LIMIT + 2)
    assert job_count(db) == LIMIT + 2


def test_concurrent_submitters_never_overshoot(settings: Settings, db: Database) -> None:
    spec = validate_spec(SPEC, settings)
    refused: list[int] = []
    start = threading.Barrier(8)

    def submit() -> None:
        start.wait()
        try:
            with db.session() as s:
                check_submission_rate(s, "alice", per_minute=5)
                jobs.submit_job(s, spec, owner="alice")
        except RateLimitedError as exc:
            refused.append(exc.retry_after_s)

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert job_count(db) == 5, "exactly the limit is stored, however the requests interleave"
    assert len(refused) == 3 and all(1 <= s <= 60 for s in refused), refused


def test_jobs_older_than_a_minute_do_not_count(settings: Settings, db: Database) -> None:
    spec = validate_spec(SPEC, settings)
    with db.session() as s:
        for _ in range(2):
            jobs.submit_job(s, spec, owner="alice")
    with db.session() as s, pytest.raises(RateLimitedError):
        check_submission_rate(s, "alice", per_minute=2)
    with db.session() as s:
        check_submission_rate(s, "alice", per_minute=2, now=utcnow() + timedelta(seconds=61))
