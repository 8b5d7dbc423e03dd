"""GET /jobs/{id}/goodput over the real app on SQLite and PostgreSQL: a job lost after step 7
and resumed from step 4 shows attempt 1's steps 5-7 as lost work with their seconds, its phases
add up to the wall time, and only the owner may read it."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from service.core.config import Settings
from service.core.states import JobState
from service.store.attempts.tokens import mint_attempt_token
from service.store.db import Database
from service.store.jobs import crud as jobs
from service.store.models import Metric, MetricSuperseded
from tests.resume_api import API, SPEC, bearer, claim, post_points, resumed_job, timeline

PHASES = (
    "queued", "starting", "restore", "productive", "checkpoint_stall", "lost", "in_progress",
    "teardown",
)  # fmt: skip


@pytest.fixture
def app_settings(settings: Settings) -> Settings:
    """What this module's ``api`` serves (tests/conftest.py)."""
    return settings.model_copy(update={"auth": "on"})


def point_time(db: Database, job_id: int, attempt: int, step: int) -> float:
    with db.session(write=False) as s:
        for table in (Metric, MetricSuperseded):
            at = s.scalar(
                select(func.max(table.time)).where(
                    table.job_id == job_id, table.attempt == attempt, table.step == step
                )
            )
            if at is not None:
                return float(at.timestamp())
    raise AssertionError(f"no point of attempt {attempt} at step {step}")


def finish(db: Database, job_id: int) -> None:
    with db.session() as s:
        t = jobs.Transition(job_id, JobState.RUNNING, JobState.SUCCEEDED, "done")
        jobs.apply_transition(s, t)


def test_the_ledger_shows_the_lost_steps_and_adds_up_to_the_wall_time(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    job_id = resumed_job(api, db, users)
    with db.session() as s:
        token = mint_attempt_token(s, job_id, 2)
    assert timeline(api, token, checkpoint_stall_s=0.004, checkpoint_saves=2) == 204
    finish(db, job_id)
    r = api.get(f"{API}/jobs/{job_id}/goodput", headers=users["alice"])
    assert r.status_code == 200, r.text
    ledger = r.json()
    one, two = ledger["attempts"]
    assert (one["attempt"], one["lost_steps"], one["lost_steps_range"]) == (1, 3, [5, 7])
    assert one["superseded_by"] == 2 and one["outcome"].startswith("requeued: worker lost")
    lost_s = point_time(db, job_id, 1, 7) - point_time(db, job_id, 1, 4)
    assert one["lost_s"] == pytest.approx(lost_s, abs=1e-5) and lost_s > 0
    assert (two["resume_step"], two["lost_steps"], two["outcome"]) == (4, 0, "succeeded")
    assert two["checkpoint_stall_s"] <= 0.004
    for line in (one, two, ledger):
        parts = sum(line[f"{p}_s"] for p in PHASES)
        assert parts == pytest.approx(line["wall_s"], abs=1e-4), line
        assert all(line[f"{p}_s"] >= 0 for p in PHASES), line
    job = api.get(f"{API}/jobs/{job_id}", headers=users["alice"]).json()
    created = jobs_time(job["created_at"])
    finished = jobs_time(job["finished_at"])
    assert ledger["wall_s"] == pytest.approx(finished - created, abs=1e-3)
    assert ledger["goodput"] == pytest.approx(ledger["productive_s"] / ledger["wall_s"], rel=1e-4)
    assert ledger["lost_steps"] == 3
    estimate = ledger["checkpoint_interval"]
    assert estimate is not None and estimate["estimate"] is True, ledger
    assert estimate["save_cost_s"] == pytest.approx(0.002)


def jobs_time(text: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def test_a_queued_job_is_all_queued_time_and_has_no_estimate(
    api: TestClient, users: dict[str, dict[str, str]]
) -> None:
    r = api.post(f"{API}/jobs", json=SPEC, headers=users["alice"])
    ledger = api.get(f"{API}/jobs/{r.json()['id']}/goodput", headers=users["alice"]).json()
    assert ledger["wall_s"] == pytest.approx(ledger["queued_s"]) and ledger["lost_steps"] == 0
    assert ledger["attempts"][0]["ended_at"] is None and ledger["checkpoint_interval"] is None
    assert ledger["goodput"] is None, "no step reported yet: nothing measured"


def test_a_job_that_ran_without_reporting_a_step_has_no_goodput(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    """A plain script's job (no ddpq.report, no --tensorboard) ran and succeeded: its goodput
    is unknown (null), not 0; one step reported makes it a number."""
    r = api.post(f"{API}/jobs", json=SPEC, headers=users["alice"])
    job_id = int(r.json()["id"])
    claim(db, job_id)
    finish(db, job_id)
    ledger = api.get(f"{API}/jobs/{job_id}/goodput", headers=users["alice"]).json()
    assert ledger["wall_s"] > 0 and ledger["goodput"] is None, ledger
    other = int(api.post(f"{API}/jobs", json=SPEC, headers=users["alice"]).json()["id"])
    token = claim(db, other)
    post_points(api, token, range(1, 3), 1.0)
    finish(db, other)
    reported = api.get(f"{API}/jobs/{other}/goodput", headers=users["alice"]).json()
    assert isinstance(reported["goodput"], float) and 0 <= reported["goodput"] <= 1, reported


def test_a_running_attempt_after_its_last_step_is_in_progress_not_teardown(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    r = api.post(f"{API}/jobs", json=SPEC, headers=users["alice"])
    job_id = int(r.json()["id"])
    token = claim(db, job_id)
    assert timeline(api, token, resume_step=0, restore_s=0.0) == 204
    post_points(api, token, range(1, 4), 1.0)
    time.sleep(0.05)  # then nothing: the attempt still runs (or hangs) after step 3
    ledger = api.get(f"{API}/jobs/{job_id}/goodput", headers=users["alice"]).json()
    (line,) = ledger["attempts"]
    assert line["ended_at"] is None and line["last_step"] == 3
    assert line["teardown_s"] == 0.0 and ledger["teardown_s"] == 0.0, "nothing tore down yet"
    assert line["in_progress_s"] >= 0.05
    for part in (line, ledger):
        assert sum(part[f"{p}_s"] for p in PHASES) == pytest.approx(part["wall_s"], abs=1e-4)
    finish(db, job_id)
    done = api.get(f"{API}/jobs/{job_id}/goodput", headers=users["alice"]).json()
    (line,) = done["attempts"]
    assert line["in_progress_s"] == 0.0 and line["teardown_s"] >= 0.05, "ended: teardown"
    assert sum(done[f"{p}_s"] for p in PHASES) == pytest.approx(done["wall_s"], abs=1e-4)


def test_only_the_owner_reads_the_ledger(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    r = api.post(f"{API}/jobs", json=SPEC, headers=users["alice"])
    job_id = int(r.json()["id"])
    token = claim(db, job_id)
    post_points(api, token, range(1, 3), 1.0)
    assert api.get(f"{API}/jobs/{job_id}/goodput", headers=users["alice"]).status_code == 200
    r = api.get(f"{API}/jobs/{job_id}/goodput", headers=users["bob"])
    assert r.status_code == 404, "another owner's job does not exist for bob"
    r = api.get(f"{API}/jobs/{job_id}/goodput", headers=bearer(token))
    assert r.status_code == 401, "an attempt token opens no user route"
    assert api.get(f"{API}/jobs/{job_id}/goodput").status_code == 401
    assert api.get(f"{API}/jobs/0/goodput", headers=users["alice"]).status_code == 422
