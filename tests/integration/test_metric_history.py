"""Metric history across a resume, over the real app on SQLite and PostgreSQL: attempt 2 tells
its resume step, earlier points of later steps move aside (still readable), each step keeps
one current point, ``latest_metrics`` follows, and every point says its attempt and how its
value was made."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, text

from service.api.metrics.schemas import HistoryOut
from service.app import create_app
from service.core.config import Settings
from service.core.wire import attempt as wire
from service.store.attempts.tokens import mint_attempt_token
from service.store.db import Database
from service.store.models import Job, JobAttempt, MetricSuperseded
from tests.resume_api import (
    API,
    SPEC,
    bearer,
    claim,
    current,
    post_points,
    requeue,
    resumed_job,
    timeline,
)


@pytest.fixture
def app_settings(settings: Settings) -> Settings:
    """What this module's ``api`` serves (tests/conftest.py)."""
    return settings.model_copy(update={"auth": "on"})


def test_a_resumed_attempt_supersedes_the_steps_it_trains_again(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    job_id = resumed_job(api, db, users)
    rows = current(db, job_id)
    assert [r[0] for r in rows] == list(range(1, 13)), f"each step exactly once: {rows}"
    assert [r[1] for r in rows] == [1] * 4 + [2] * 8, "steps 5-12 from attempt 2"
    assert [r[2] for r in rows[4:7]] == [205.0, 206.0, 207.0], "attempt 2's values, not 1's"
    with db.session(write=False) as s:
        old = s.execute(
            select(MetricSuperseded.step, MetricSuperseded.attempt, MetricSuperseded.value)
            .where(MetricSuperseded.job_id == job_id)
            .order_by(MetricSuperseded.step)
        ).all()
        told = s.get(JobAttempt, (job_id, 2))
    assert [tuple(r) for r in old] == [(5, 1, 105.0), (6, 1, 106.0), (7, 1, 107.0)]
    assert told is not None and (told.resume_step, told.restore_s) == (4, 0.5)

    r = api.get(f"{API}/jobs/{job_id}", headers=users["alice"])
    assert r.json()["latest_metrics"]["loss"] == 212.0


def test_the_api_answer_names_attempt_and_aggregation_and_keeps_superseded_points(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    job_id = resumed_job(api, db, users)
    alice = users["alice"]
    r = api.get(f"{API}/jobs/{job_id}/metrics", params={"name": "loss"}, headers=alice)
    points = r.json()["points"]
    assert [p["step"] for p in points] == list(range(1, 13))
    assert points[0]["attempt"] == 1 and points[0]["agg"] == "mean" and points[0]["ranks"] == 2
    assert points[4]["attempt"] == 2 and points[4]["value"] == 205.0
    assert points[11]["agg"] == "rank0" and points[11]["ranks"] is None, points[11]
    assert "superseded" not in points[0], "the plain poll carries no history flags"

    r = api.get(
        f"{API}/jobs/{job_id}/metrics",
        params={"name": "loss", "include_superseded": "true"},
        headers=alice,
    )
    assert HistoryOut.model_validate_json(r.text).model_dump_json().encode() == r.content
    both = [(p["step"], p["attempt"], p["superseded"]) for p in r.json()["points"]]
    assert both[4:10] == [
        (5, 1, True), (5, 2, False), (6, 1, True), (6, 2, False), (7, 1, True), (7, 2, False),
    ], both  # fmt: skip
    assert len(both) == 15
    page = api.get(
        f"{API}/jobs/{job_id}/metrics",
        params={"name": "loss", "include_superseded": "true", "after_step": 5, "limit": 1},
        headers=alice,
    ).json()
    assert [(p["step"], p["superseded"]) for p in page["points"]] == [(6, True), (6, False)]
    assert page["next_after_step"] == 6
    sampled = api.get(
        f"{API}/jobs/{job_id}/metrics",
        params={"name": "loss", "include_superseded": "true", "max_points": 4},
        headers=alice,
    ).json()["points"]
    assert sum(p["superseded"] for p in sampled) == 3, "downsampled: every superseded point"

    # Who may read it: the owner; another owner gets 404, an attempt token 401.
    r = api.get(f"{API}/jobs/{job_id}/metrics", headers=users["bob"])
    assert r.status_code == 404, r.text
    with db.session() as s:
        token = mint_attempt_token(s, job_id, 2)
    r = api.get(f"{API}/jobs/{job_id}/metrics", headers=bearer(token))
    assert r.status_code == 401, r.text


def test_superseded_points_are_capped_paged_and_downsampled(
    settings: Settings, db: Database, users: dict[str, dict[str, str]]
) -> None:
    capped = settings.model_copy(update={"auth": "on", "max_metric_points": 50})
    with TestClient(create_app(capped)) as api:
        job_id = resumed_job(api, db, users)
        # A long attempt 1 that attempt 2 (resumed from step 4) superseded: steps 8-307.
        with db.session() as s:
            s.add_all(
                MetricSuperseded(job_id=job_id, name="loss", step=step, attempt=1,
                                 value=float(step % 17), ranks=2, superseded_by=2)
                for step in range(8, 308)
            )  # fmt: skip
        url, alice = f"{API}/jobs/{job_id}/metrics", users["alice"]
        seen: list[tuple[int, int, bool]] = []
        after, pages = 0, 0
        while True:
            body = api.get(url, params={"name": "loss", "include_superseded": "true",
                                        "after_step": after, "limit": 10_000},
                           headers=alice).json()  # fmt: skip
            assert len(body["points"]) <= 50, "capped by DDPQ_MAX_METRIC_POINTS"
            seen += [(p["step"], p["attempt"], p["superseded"]) for p in body["points"]]
            if body["next_after_step"] == after:
                break
            after, pages = body["next_after_step"], pages + 1
        assert pages > 1
        assert len(seen) == len(set(seen)) == 12 + 3 + 300, "every point exactly once"
        history = {"name": "loss", "include_superseded": "true"}
        small = api.get(url, params={**history, "limit": 7}, headers=alice).json()
        assert len(small["points"]) <= 7 and small["next_after_step"] < 12
        sampled = api.get(url, params={**history, "max_points": 20}, headers=alice).json()
        sampled = sampled["points"]
        old = [p for p in sampled if p["superseded"]]
        assert 2 <= len(old) <= 20, "superseded points downsampled too"
        assert old[0]["step"] == 5 and old[-1]["step"] == 307, "each end survives"
        assert [p["step"] for p in sampled if not p["superseded"]] == list(range(1, 13))


def test_within_one_attempt_a_repeated_step_keeps_its_first_value(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    job_id = resumed_job(api, db, users)
    with db.session() as s:
        token = mint_attempt_token(s, job_id, 2)
    ack = post_points(api, token, range(3, 13), 900.0)  # 3-4: attempt 1's, ≤ resume step
    assert ack["inserted"] == 0, ack
    assert timeline(api, token, resume_step=1) == 204, "a second resume step is ignored"
    rows = current(db, job_id)
    assert [r[2] for r in rows] == [101.0, 102.0, 103.0, 104.0, *(200.0 + s for s in range(5, 13))]


def test_latest_metrics_roll_back_to_the_resume_point_until_new_points_arrive(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    r = api.post(f"{API}/jobs", json=SPEC, headers=users["alice"])
    job_id = int(r.json()["id"])
    first = claim(db, job_id)
    post_points(api, first, range(1, 8), 100.0)
    requeue(db, job_id)
    second = claim(db, job_id)
    assert timeline(api, second, resume_step=4) == 204
    with db.session(write=False) as s:
        latest = s.scalar(select(Job.latest_metrics).where(Job.id == job_id))
    assert latest == {"loss": {"step": 4, "value": 104.0}}, "attempt 1's step 7 is gone"
    post_points(api, second, range(5, 6), 200.0)
    with db.session(write=False) as s:
        latest = s.scalar(select(Job.latest_metrics).where(Job.id == job_id))
    assert latest == {"loss": {"step": 5, "value": 205.0}}


def test_the_timeline_route_is_for_the_current_attempt_token_only(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    r = api.post(f"{API}/jobs", json=SPEC, headers=users["alice"])
    job_id = int(r.json()["id"])
    token = claim(db, job_id)
    r = api.post(API + wire.TIMELINE_PATH, json={"resume_step": 0}, headers=users["alice"])
    assert r.status_code == 401, "a user token opens no attempt route"
    assert timeline(api, token, resume_step=-1) == 422
    assert timeline(api, token, job_id=job_id) == 422, "no route takes a job id"
    assert timeline(api, token, checkpoint_stall_s=1.5, checkpoint_saves=2) == 204
    requeue(db, job_id)
    assert timeline(api, token, checkpoint_stall_s=9.0) == 409, "a superseded attempt"
    with db.session(write=False) as s:
        row = s.get(JobAttempt, (job_id, 1))
    assert row is not None and (row.checkpoint_stall_s, row.checkpoint_saves) == (1.5, 2)


def test_postgresql_polls_stay_index_only_with_the_new_columns(db: Database) -> None:
    if db.engine.dialect.name != "postgresql":
        pytest.skip("INCLUDE columns exist on PostgreSQL only")
    with db.engine.connect() as conn:
        definition = conn.execute(
            text("SELECT pg_get_indexdef('pk_metrics'::regclass)")
        ).scalar_one()
    assert 'INCLUDE (attempt, epoch, value, "time", ranks)' in definition, definition
