"""Write-time rollups answer as the read-time min/max buckets do (both databases).

Random histories go in through the real ingest (batches in any order, resends, NaN and ±inf,
ties), a resumed attempt supersedes the steps after its resume point, and then: every rollup
bucket equals the one computed from the current points, and ``curves.curve`` keeps exactly
the points a read-time window query keeps for the same bucket edges, over the whole history
and over random zoom ranges.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Integer, and_, func, literal, select
from sqlalchemy.orm import Session

from service.app import create_app
from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs import crud as jobs
from service.store.metrics import curves, rollups
from service.store.metrics.history import supersede_after_resume
from service.store.metrics.points import MetricPoint, record_metrics
from service.store.models import Metric, MetricRollup, utcnow
from service.store.workers import registry as workers

SPEC = JobSpec(name="j", task="regression")
VALUES = st.one_of(
    st.sampled_from([0.0, 1.0, -1.0, 2.5, math.nan, math.inf, -math.inf]),
    st.floats(-1e6, 1e6, allow_nan=False),
)
HISTORY = st.dictionaries(st.integers(1, 2**17), VALUES, min_size=1, max_size=300)


def _claim_running(db: Database, job_id: int) -> int:
    """Claim ``job_id`` (the only queued job) and make it running; its attempt."""
    with db.session() as s:
        claimed = None
        while claimed is None or claimed.id != job_id:  # an earlier example's leftover first
            claimed = claims.claim_next_job(
                s, worker_id="w", launcher="local", max_gpus_per_node=0, lease_s=30
            )
            assert claimed is not None
        jobs.apply_transition(s, jobs.Transition(job_id, JobState.STARTING, JobState.RUNNING))
        return int(claimed.attempt)


def _new_job(db: Database) -> int:
    with db.session() as s:
        job, _ = jobs.submit_job(s, SPEC, owner="o")
        workers.register_worker(s, worker_id="w", host="h", pid=1, launcher="local", capacity={})
    _claim_running(db, job.id)
    return job.id


def _send(db: Database, job_id: int, attempt: int, points: Sequence[MetricPoint]) -> None:
    with db.session(one_statement=True) as s:
        record_metrics(s, job_id, attempt, points)


def _current(s: Session, job_id: int) -> list[tuple[int, float | None]]:
    rows = s.execute(
        select(Metric.step, Metric.value)
        .where(Metric.job_id == job_id, Metric.name == "loss")
        .order_by(Metric.step)
    )
    return [(int(a), b) for a, b in rows]


def _expected_rollups(points: list[tuple[int, float | None]]) -> dict[tuple[int, int], tuple]:
    """Each level's buckets from the points, by sorting (NaN after numbers, ties by step)."""
    out = {}
    for k in rollups.LEVELS:
        groups: dict[int, list[tuple[int, float | None]]] = {}
        for step, value in points:
            groups.setdefault(step >> k, []).append((step, value))
        for b, pts in groups.items():
            low = sorted(pts, key=lambda p: (p[1] is None, p[1] if p[1] is not None else 0, p[0]))
            high = sorted(pts, key=lambda p: (p[1] is None, -p[1] if p[1] is not None else 0, p[0]))
            first, last = min(pts), max(pts)
            out[(k, b)] = (len(pts), *low[0], *high[0], *first, *last)
    return out


def _stored_rollups(s: Session, job_id: int) -> dict[tuple[int, int], tuple]:
    r = MetricRollup
    rows = s.execute(
        select(
            r.level,
            r.bucket,
            r.count,
            r.min_step,
            r.min_value,
            r.max_step,
            r.max_value,
            r.first_step,
            r.first_value,
            r.last_step,
            r.last_value,
        ).where(r.job_id == job_id, r.name == "loss")
    )
    return {(int(row[0]), int(row[1])): tuple(row[2:]) for row in rows}


def _read_time_steps(
    s: Session, job_id: int, lo: int, hi: int, max_points: int
) -> list[int] | None:
    """What a read-time window query over every point keeps for the same edges as
    ``curves.curve`` (None: the whole range)."""
    where = and_(Metric.job_id == job_id, Metric.name == "loss", Metric.step.between(lo, hi))
    count = s.scalar(select(func.count()).where(where))
    if hi - lo + 1 <= max_points or count <= max_points:
        return None
    keep = {lo, hi}
    if max_points >= 4:
        shift = curves.display_shift(lo, hi, (max_points - 2) // 2)
        bucket = Metric.step.op(">>")(literal(shift, Integer()))
        low = (Metric.value.is_(None), Metric.value.asc(), Metric.step)
        high = (Metric.value.is_(None), Metric.value.desc(), Metric.step)
        ranked = (
            select(
                Metric.step,
                func.row_number().over(partition_by=bucket, order_by=low).label("rn_min"),
                func.row_number().over(partition_by=bucket, order_by=high).label("rn_max"),
            )
            .where(where)
            .subquery()
        )
        keep.update(
            s.scalars(select(ranked.c.step).where((ranked.c.rn_min == 1) | (ranked.c.rn_max == 1)))
        )
    return sorted(keep)


def _check(db: Database, job_id: int, data: st.DataObject) -> None:
    with db.session(write=False) as s:
        points = _current(s, job_id)
        assert _stored_rollups(s, job_id) == _expected_rollups(points)
        steps = [p for p, _ in points]
        ranges = [(1, 2**53 - 1)]
        for _ in range(3):
            a = data.draw(st.integers(1, 2**17 + 10))
            ranges.append((a, data.draw(st.integers(a, 2**17 + 10))))
        for lo_req, hi_req in ranges:
            max_points = data.draw(st.sampled_from([2, 3, 4, 5, 10, 37, 200, 1000]))
            inside = [x for x in steps if lo_req <= x <= hi_req]
            got = [p.step for p in curves.curve(s, job_id, "loss", max_points=max_points,
                                                from_step=lo_req, to_step=hi_req)]  # fmt: skip
            if not inside:
                assert got == []
                continue
            want = _read_time_steps(s, job_id, inside[0], inside[-1], max_points)
            assert got == (inside if want is None else want), (lo_req, hi_req, max_points)
            assert len(got) <= max(max_points, 2)


@settings(
    max_examples=int(os.environ.get("DDPQ_ROLLUP_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(history=HISTORY, later=HISTORY, data=st.data())
def test_rollups_and_curves_match_the_read_time_buckets(
    db: Database, history: dict[int, float], later: dict[int, float], data: st.DataObject
) -> None:
    job_id = _new_job(db)
    batch = [MetricPoint("loss", step, value) for step, value in history.items()]
    order = data.draw(st.permutations(batch))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(order)), max_size=5)))
    chunks = [order[a:b] for a, b in zip([0, *cuts], [*cuts, len(order)], strict=True)]
    for chunk in chunks:
        _send(db, job_id, 1, chunk)
    _send(db, job_id, 1, data.draw(st.sampled_from(chunks)))  # a resend adds nothing
    _check(db, job_id, data)

    # A resume: attempt 2 trains again from step ``resume``; earlier points after it move.
    resume = data.draw(st.integers(0, 2**17))
    with db.session() as s:
        jobs.apply_transition(s, jobs.Transition(job_id, JobState.RUNNING, JobState.QUEUED))
    attempt = _claim_running(db, job_id)
    with db.session() as s:
        supersede_after_resume(s, job_id, attempt, resume)
    _send(db, job_id, attempt, [MetricPoint("loss", k, v) for k, v in later.items() if k > resume])
    _check(db, job_id, data)


def test_a_rebuild_restores_rollups_of_points_written_around_the_ingest(db: Database) -> None:
    job_id = _new_job(db)
    _send(db, job_id, 1, [MetricPoint("loss", k, float(k % 7)) for k in range(1, 5000)])
    with db.session() as s:
        before = _stored_rollups(s, job_id)
        s.execute(MetricRollup.__table__.delete())
    with db.session() as s:
        rollups.rebuild_job(s, job_id)
    with db.session(write=False) as s:
        assert _stored_rollups(s, job_id) == before == _expected_rollups(_current(s, job_id))


@pytest.fixture
def app_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"auth": "on"})


def test_the_metrics_route_zooms_and_refuses_a_reversed_range(
    db: Database, settings: Settings
) -> None:
    from service.store.auth.tokens import create_token

    job_id = _new_job(db)
    _send(db, job_id, 1, [MetricPoint("loss", k, math.sin(k / 50)) for k in range(1, 20_001)])
    with db.session() as s:
        alice = create_token(s, owner="o")[1]
        bob = create_token(s, owner="bob")[1]
    url = f"/api/v1/jobs/{job_id}/metrics"
    with TestClient(create_app(settings.model_copy(update={"auth": "on"}))) as api:
        head = {"Authorization": f"Bearer {alice}"}
        whole = api.get(url, params={"max_points": 100}, headers=head).json()["points"]
        zoom = api.get(url, params={"max_points": 100, "from_step": 1000, "to_step": 1999},
                       headers=head).json()["points"]  # fmt: skip
        assert whole[0]["step"] == 1 and whole[-1]["step"] == 20_000 and len(whole) <= 100
        assert zoom[0]["step"] == 1000 and zoom[-1]["step"] == 1999 and 50 <= len(zoom) <= 100
        page = api.get(url, params={"from_step": 10, "to_step": 12}, headers=head).json()
        assert [p["step"] for p in page["points"]] == [10, 11, 12]
        bad = api.get(url, params={"from_step": 5, "to_step": 4, "max_points": 10}, headers=head)
        assert bad.status_code == 422 and "to_step" in bad.text
        other = api.get(url, params={"max_points": 100}, headers={"Authorization": f"Bearer {bob}"})
        assert other.status_code == 404, "another owner's job is not found"
        assert api.get(url, params={"max_points": 100}).status_code == 401


def test_the_migration_backfills_the_rollups_of_points_stored_before_it(db_url: str) -> None:
    """A database with points from before rollups existed (revision 0011) gets every bucket
    at upgrade, as the ingest would have kept it (NaN, ±inf and ties included)."""
    from service.store import migrate

    database = Database.from_url(db_url)
    try:
        migrate.upgrade(database.engine, "0011")
        job_id = _new_job(database)
        values = [math.nan, math.inf, -math.inf, 1.0, 1.0, -2.0, 0.5]
        with database.session() as s:
            s.execute(
                Metric.__table__.insert(),
                [
                    {"job_id": job_id, "name": name, "step": k, "attempt": 1, "epoch": 0,
                     "value": None if math.isnan(v) else v, "time": utcnow()}
                    for name in ("loss", "acc")
                    for k in range(1, 70_001, 7)
                    for v in [values[k % len(values)]]
                ],
            )  # fmt: skip
        migrate.upgrade(database.engine)
        with database.session(write=False) as s:
            got = _stored_rollups(s, job_id)
            assert len(got) > 1000 and got == _expected_rollups(_current(s, job_id))
            curve = curves.curve(s, job_id, "loss", max_points=200)
            assert 2 < len(curve) <= 200
    finally:
        database.dispose()
