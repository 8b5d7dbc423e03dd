"""The fast ingest, poll and claim statements keep the semantics of the slow ones (both DBs).

``record_metrics`` fences and inserts in one statement on PostgreSQL (one JSON parameter read by
``json_to_recordset``, run in autocommit by the sink's one-statement scope) and as one
executemany on SQLite; ``query_points`` reads plain rows (an index-only scan on
PostgreSQL); ``claim_next_job`` claims and writes its event in one statement on PostgreSQL.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import event, text, update

from service.core.errors import DatabaseUnavailableError, StaleAttemptError
from service.core.metrics.points import checked_point
from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.core.wire.metric_columns import CheckedColumns, columns_of_points
from service.store import migrate
from service.store.attempts.values import AttemptRef
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs import crud as jobs
from service.store.metrics import points as metrics
from service.store.metrics import service as metric_service
from service.store.metrics.points import MetricPoint
from service.store.models import Job, utcnow
from service.store.workers import registry as workers

SPEC = JobSpec(name="j", task="regression")


def _running_job(db: Database) -> int:
    with db.session() as s:
        job, _ = jobs.submit_job(s, SPEC, owner="o")
        workers.register_worker(s, worker_id="w", host="h", pid=1, launcher="local", capacity={})
    with db.session() as s:
        claimed = claims.claim_next_job(
            s, worker_id="w", launcher="local", max_gpus_per_node=0, lease_s=30
        )
        assert claimed is not None and claimed.id == job.id
        jobs.apply_transition(s, jobs.Transition(job.id, JobState.STARTING, JobState.RUNNING))
    return job.id


def _steps(db: Database, job_id: int, name: str = "loss") -> list[int]:
    with db.session(write=False) as s:
        return [p.step for p in metrics.query_points(s, job_id, name, limit=100_000)[0]]


def test_a_stale_write_stores_nothing_even_when_its_error_is_swallowed(db: Database) -> None:
    job_id = _running_job(db)
    with db.session() as s:
        jobs.apply_transition(s, jobs.Transition(job_id, JobState.RUNNING, JobState.QUEUED))
    # The session commits: its caller swallowed the error.
    with db.session() as s, pytest.raises(StaleAttemptError, match="attempt 1 is stale"):
        metrics.record_metrics(s, job_id, 1, [MetricPoint("loss", 1, 0.5)])
    assert _steps(db, job_id) == []


def test_repeated_steps_in_one_batch_count_once(db: Database) -> None:
    job_id = _running_job(db)
    batch = [MetricPoint("loss", 5, 1.0), MetricPoint("loss", 5, 2.0), MetricPoint("acc", 5, 0.1)]
    with db.session() as s:
        assert metrics.record_metrics(s, job_id, 1, batch) == 2
    with db.session() as s:
        assert metrics.record_metrics(s, job_id, 1, batch) == 0
    assert _steps(db, job_id) == [5] and _steps(db, job_id, "acc") == [5]


def test_points_keep_their_time_epoch_and_non_finite_values(db: Database) -> None:
    job_id = _running_job(db)
    at = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone(timedelta(hours=2)))
    batch = [
        MetricPoint("loss", 1, math.inf, 0, at),
        MetricPoint("loss", 2, -math.inf, None, at),
        MetricPoint("loss", 3, math.nan, 7),
        MetricPoint("loss", 4, 0.25, 1),
    ]
    before = utcnow()
    with db.session() as s:
        assert metrics.record_metrics(s, job_id, 1, batch) == 4
    with db.session(write=False) as s:
        points, cursor = metrics.query_points(s, job_id, "loss")
    assert cursor == 4
    assert [(p.step, p.epoch, p.value) for p in points] == [
        (1, 0, math.inf),
        (2, None, -math.inf),
        (3, 7, None),
        (4, 1, 0.25),
    ]
    assert points[0].time == at and points[0].time.tzinfo is not None
    assert points[3].time >= before, "a point without a time gets the write's time"
    with db.session(write=False) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.latest_metrics == {"loss": {"step": 4, "value": 0.25}}


def test_a_naive_time_is_refused_and_nothing_is_stored(db: Database) -> None:
    job_id = _running_job(db)
    naive = datetime(2026, 1, 1, 12, 0, 0)
    with pytest.raises(ValueError, match="naive datetime"), db.session() as s:
        metrics.record_metrics(s, job_id, 1, [MetricPoint("loss", 1, 1.0, 0, naive)])
    assert _steps(db, job_id) == []


def test_a_large_batch_goes_in_whole(db: Database) -> None:
    job_id = _running_job(db)
    batch = [MetricPoint(f"m{i % 3}", i, float(i), i // 100) for i in range(1, 5001)]
    with db.session() as s:
        assert metrics.record_metrics(s, job_id, 1, batch) == 5000
    with db.session(write=False) as s:
        points, cursor = metrics.query_points(s, job_id, "m1", after_step=4000, limit=10)
    assert [p.step for p in points] == list(range(4003, 4031, 3)) and cursor == 4030


def test_a_poll_reads_only_the_primary_key_index_on_postgresql(pg_schema_url: str) -> None:
    db = Database.from_url(pg_schema_url)
    try:
        migrate.upgrade(db.engine)
        job_id = _running_job(db)
        with db.session() as s:
            metrics.record_metrics(
                s, job_id, 1, [MetricPoint("loss", i, 0.5) for i in range(1, 2001)]
            )
        with db.engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("VACUUM ANALYZE"))
        seen: list[tuple[str, object]] = []

        def capture(_c: object, _cur: object, sql: str, params: object, *_: object) -> None:
            seen.append((sql, params))

        event.listen(db.engine, "before_cursor_execute", capture)
        with db.session(write=False) as s:
            points, _ = metrics.query_points(s, job_id, "loss", after_step=1000, limit=1000)
        event.remove(db.engine, "before_cursor_execute", capture)
        assert len(points) == 1000
        [(sql, params)] = seen
        with db.engine.connect() as conn:
            # The planner may prefer a scan of a tiny table; the question is whether the
            # index alone answers the poll, i.e. whether it covers every column read.
            conn.exec_driver_sql("SET enable_seqscan = off")
            conn.exec_driver_sql("SET enable_bitmapscan = off")
            plan = "\n".join(r[0] for r in conn.exec_driver_sql(f"EXPLAIN {sql}", params))  # type: ignore[arg-type]
        assert "Index Only Scan using pk_metrics" in plan, plan
    finally:
        db.dispose()


def test_a_claim_refreshes_a_job_already_loaded_and_records_its_event(db: Database) -> None:
    with db.session() as s:
        job, _ = jobs.submit_job(s, SPEC, owner="o")
        workers.register_worker(s, worker_id="w", host="h", pid=1, launcher="local", capacity={})
    with db.session() as s:
        loaded = jobs.get_job(s, job.id)
        assert loaded.state == "queued"
        claimed = claims.claim_next_job(
            s, worker_id="w", launcher="local", max_gpus_per_node=0, lease_s=30
        )
        assert claimed is loaded, "one identity per row in a session"
        assert (claimed.state, claimed.worker_id, claimed.attempt) == ("starting", "w", 1)
        assert claimed.lease_expires_at is not None
        lease_s = (claimed.lease_expires_at - datetime.now(UTC)).total_seconds()
        assert 20 < lease_s <= 30
    with db.session(write=False) as s:
        events = jobs.list_events(s, job.id)
    assert [(e.from_state, e.to_state, e.reason, e.worker_id) for e in events] == [
        (None, "queued", None, None),
        ("queued", "starting", "claimed", "w"),
    ]
    assert events[1].created_at == claimed.updated_at


def test_a_late_batch_never_overwrites_a_newer_latest_value(db: Database) -> None:
    job_id = _running_job(db)
    with db.session() as s:
        metrics.record_metrics(s, job_id, 1, [MetricPoint("loss", 10, 0.1)], progress={"step": 10})
    with db.session() as s:  # a replayed, older batch: loss stays at step 10, acc is new
        late = [MetricPoint("loss", 5, 0.5), MetricPoint("acc", 5, math.nan)]
        assert metrics.record_metrics(s, job_id, 1, late) == 2
    with db.session(write=False) as s:
        job = s.get(Job, job_id)
        assert job is not None
        assert job.latest_metrics == {
            "loss": {"step": 10, "value": 0.1},
            "acc": {"step": 5, "value": None},
        }
        assert job.progress == {"step": 10}, "progress is kept when a batch brings none"
    with db.session() as s:
        metrics.record_metrics(s, job_id, 1, [MetricPoint("loss", 11, math.inf)], progress={})
    with db.session(write=False) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.progress == {}
        assert job.latest_metrics is not None
        assert job.latest_metrics["loss"] == {"step": 11, "value": "Infinity"}


def test_the_one_statement_scope_writes_atomically_and_fences(db: Database) -> None:
    """The sink's scope: autocommit on PostgreSQL (no BEGIN/COMMIT round trips), the plain
    write transaction on SQLite; either way the batch lands whole or not at all."""
    job_id = _running_job(db)
    odd = 'val/acc "top-1" \\ \u00e9\u4e2d {x,y}'  # quotes, backslash, non-ASCII, braces
    batch = [MetricPoint(odd, 1, 0.5), MetricPoint("loss", 1, 2.0)]
    with db.session(one_statement=True) as s:
        if db.dialect == "postgresql":
            assert s.connection().connection.driver_connection.autocommit is True
        else:  # BEGIN IMMEDIATE: a deferred BEGIN made the sink's fenced write "database is
            # locked" at once under a concurrent writer, instead of waiting for the lock
            assert s.connection().get_execution_options().get("ddpq_write") is True
        assert metrics.record_metrics(s, job_id, 1, batch, progress={"step": 1}) == 2
    assert _steps(db, job_id, odd) == [1] and _steps(db, job_id) == [1]
    with db.session() as s:
        jobs.apply_transition(s, jobs.Transition(job_id, JobState.RUNNING, JobState.QUEUED))
    with db.session(one_statement=True) as s, pytest.raises(StaleAttemptError):
        metrics.record_metrics(s, job_id, 1, [MetricPoint("loss", 2, 1.0)], progress={"step": 2})
    assert _steps(db, job_id) == [1]
    with db.session(write=False) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.progress == {"step": 1}, "a stale write changed progress"


def test_progress_alone_keeps_an_empty_latest_metrics_a_mapping(db: Database) -> None:
    job_id = _running_job(db)
    with db.session(one_statement=True) as s:  # the sink's write of progress with no points
        assert metrics.record_metrics(s, job_id, 1, [], progress={"step": 0}) == 0
    with db.session(write=False) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.progress == {"step": 0}
        assert job.latest_metrics in ({}, None), job.latest_metrics
    with db.session(one_statement=True) as s:
        metrics.record_metrics(s, job_id, 1, [MetricPoint("loss", 1, 0.5)])
    with db.session(write=False) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.latest_metrics == {"loss": {"step": 1, "value": 0.5}}


# ---- the API's ingest on the driver's connection (PostgreSQL) -------------------------------


def _batch(*points: MetricPoint) -> CheckedColumns:
    return columns_of_points([checked_point(p) for p in points])


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_the_driver_path_stores_fences_and_hands_the_connection_back_as_it_found_it(
    db: Database,
) -> None:
    """``record_batch`` on PostgreSQL runs ``PG_RECORD`` through ``Database.one_row``: the
    batch lands once (a resend inserts 0), a superseded attempt stores nothing, and the pooled
    connection goes back out of autocommit, so the next session's rollback still undoes."""
    # One pooled connection, so the session below gets the one the ingest used.
    db = Database.from_url(db.engine.url.render_as_string(hide_password=False), pool_size=1,
                           max_overflow=0)  # fmt: skip
    job_id = _running_job(db)
    ref = AttemptRef(job_id, 1)
    batch = _batch(MetricPoint("loss", 1, 0.5), MetricPoint("loss", 2, 0.25))
    assert metric_service.record_batch(db, ref, batch, progress={"step": 2}) == 2
    assert metric_service.record_batch(db, ref, batch, progress={"step": 2}) == 0
    assert _steps(db, job_id) == [1, 2]
    pooled = db.engine.raw_connection()  # the pool's one connection
    assert pooled.driver_connection.autocommit is False  # type: ignore[union-attr]
    pooled.close()
    with pytest.raises(RuntimeError), db.session() as s:
        s.execute(update(Job).where(Job.id == job_id).values(progress={"step": 99}))
        raise RuntimeError("undo")
    with db.session() as s:
        jobs.apply_transition(s, jobs.Transition(job_id, JobState.RUNNING, JobState.QUEUED))
    with pytest.raises(StaleAttemptError, match="attempt superseded"):
        metric_service.record_batch(db, ref, _batch(MetricPoint("loss", 3, 0.1)), progress=None)
    assert _steps(db, job_id) == [1, 2]
    with db.session(write=False) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.progress == {"step": 2}
    db.dispose()


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_one_row_translates_driver_errors_and_drops_a_killed_connection(db: Database) -> None:
    """A failing statement is the usual 503 error; a backend killed under the statement is
    dropped from the pool, and the next statement runs on a fresh connection."""
    with pytest.raises(DatabaseUnavailableError):
        db.one_row("SELECT 1 / %(zero)s AS x", {"zero": 0})
    first = db.one_row("SELECT pg_backend_pid() AS pid", {})
    assert first is not None
    (pid,) = first
    with pytest.raises(DatabaseUnavailableError, match="unavailable"):
        db.one_row("SELECT pg_terminate_backend(pg_backend_pid()) AS gone", {})
    row = db.one_row("SELECT pg_backend_pid() AS pid, %(a)s::int AS a", {"a": 7})
    assert row is not None and row[1] == 7 and row[0] != pid, row
    assert db.one_row("SELECT 1 WHERE false", {}) is None, "no row: None"
    with pytest.raises(ValueError, match="through psycopg only"):
        Database.from_url("sqlite://").one_row("SELECT 1", {})
    nowhere = Database.from_url("postgresql+psycopg://postgres@127.0.0.1:1/test")
    with pytest.raises(DatabaseUnavailableError, match="unavailable"):  # 503, not a 500
        nowhere.one_row("SELECT 1 AS x", {})
    nowhere.dispose()
