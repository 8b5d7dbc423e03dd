"""Idempotency-Key on POST /sweeps, on SQLite and PostgreSQL: a retried POST returns the
sweep it made (never a second one), the key with another sweep is 422, keys are per owner."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from service.core.config import Settings
from service.core.sweeps.spec import SweepSpec, plan_trials, resolve_objective
from service.store.db import Database
from service.store.models import Job, Sweep
from service.store.sweeps import crud as sweeps
from tests.uploads import API, mint, running_job, upload

SWEEP: dict[str, Any] = {
    "name": "grid",
    "base": {"name": "b", "task": "regression", "training": {"max_steps": 5}},
    "axes": {"training.lr": {"grid": [0.001, 0.01]}},
}


@pytest.fixture
def app_settings(settings: Settings) -> Settings:
    """What this module's ``api`` serves (tests/conftest.py)."""
    return settings.model_copy(update={"auth": "on"})


def stored(db: Database) -> tuple[int, int]:
    with db.session(write=False) as s:
        return (
            s.scalar(select(func.count()).select_from(Sweep)) or 0,
            s.scalar(select(func.count()).select_from(Job).where(Job.sweep_id.is_not(None))) or 0,
        )


def test_a_retried_post_returns_the_same_sweep(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    alice = {**users["alice"], "Idempotency-Key": "sweep-1"}
    first = api.post(f"{API}/sweeps", json=SWEEP, headers=alice)
    assert first.status_code == 201, first.text
    again = api.post(f"{API}/sweeps", json=SWEEP, headers=alice)
    assert again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"] and again.json()["trials_total"] == 2
    assert stored(db) == (1, 2), "no second sweep, no second set of trials"

    other = {**SWEEP, "axes": {"training.lr": {"grid": [0.5]}}}
    r = api.post(f"{API}/sweeps", json=other, headers=alice)
    assert r.status_code == 422, r.text
    (err,) = r.json()["detail"]
    assert err["loc"] == ["header", "Idempotency-Key"] and "different sweep" in err["msg"]
    assert stored(db) == (1, 2)

    # Keys are per owner: bob's same key is his own, new sweep (nothing of alice's shown).
    bob = {**users["bob"], "Idempotency-Key": "sweep-1"}
    r = api.post(f"{API}/sweeps", json=other, headers=bob)
    assert r.status_code == 201 and r.json()["id"] != first.json()["id"], r.text
    r = api.post(f"{API}/sweeps", json=SWEEP, headers={**users["alice"], "Idempotency-Key": ""})
    assert r.status_code == 422, "an empty key is refused"


def test_a_replay_of_latest_matches_the_checkpoint_it_meant(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    source = running_job(db, "alice")
    rank = mint(db, source)
    assert upload(api, rank, b"one", 1, 1024).status_code == 201
    body = {**SWEEP, "base": {**SWEEP["base"], "init_from": {"job": source}}}
    alice = {**users["alice"], "Idempotency-Key": "ft"}
    first = api.post(f"{API}/sweeps", json=body, headers=alice)
    assert first.status_code == 201, first.text
    assert upload(api, rank, b"two", 2, 1024).status_code == 201  # "latest" moved on
    again = api.post(f"{API}/sweeps", json=body, headers=alice)
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"], again.text


def test_a_racing_insert_with_the_key_returns_the_winner(settings: Settings, db: Database) -> None:
    spec = SweepSpec.model_validate(SWEEP)
    planned, objective = plan_trials(spec, settings), resolve_objective(spec)
    with db.session() as s:
        winner, created = sweeps.submit_sweep_once(
            s, spec, objective, planned, owner="o", idempotency_key="k"
        )
        assert created
        winner_id = winner.id
    # The loser had not seen the winner's row when it looked: the unique key catches it.
    with db.session() as s:
        loser, created = sweeps.submit_sweep_once(
            s, spec, objective, planned, owner="o", idempotency_key="k"
        )
        assert not created and loser.id == winner_id
    assert stored(db) == (1, 2)
