"""Metric ingest (duplicate-safe, fenced by attempt), progress, and metric queries."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any, cast

from sqlalchemy import CursorResult, and_, column, func, select, text, update
from sqlalchemy.dialects import sqlite
from sqlalchemy.orm import Session

from service.core.limits import METRIC_PAGE_POINTS
from service.core.metrics.points import CheckedPoint, checked_point, json_safe
from service.core.metrics.points import MetricPoint as MetricPoint  # re-exported for callers
from service.core.owners.quotas import MetricQuotas
from service.core.states import ACTIVE_STATES
from service.core.wire.metric_columns import CheckedColumns, columns_of_points
from service.store.metrics.quotas import (
    latest_metrics,
    names_stored,
    quota_refusal,
    window_start,
)
from service.store.metrics.rollups import PG_ROLLUP_CTE, add_points
from service.store.metrics.values import PointRow
from service.store.models import Job, Metric, utcnow
from service.store.workers.leases import fence_attempt, lock_attempt

_ACTIVE = frozenset(s.value for s in ACTIVE_STATES)
# The active states as an SQL array literal written into ``_PG_RECORD``: fixed names, so a
# parameter (and psycopg dumping a list for every batch) buys nothing.
assert all(re.fullmatch("[a-z_]+", s) for s in _ACTIVE)
_PG_ACTIVE = "ARRAY[" + ", ".join(f"'{s}'" for s in sorted(_ACTIVE)) + "]"


# PostgreSQL: a whole ``record_metrics`` in one statement, so it needs no transaction of its
# own (``Database.session(one_statement=True)`` runs it in autocommit). The CTE ``job`` takes
# the row lock that ``leases.check_attempt`` takes; the insert and the job update happen only
# while the attempt is current and active (``ok``), and the caller gets the fence columns back
# to raise the same errors as ``leases.check_attempt``. The batch travels as one JSON
# text array per column (names, steps, epochs, values, times, ranks), zipped back into rows
# by ``ROWS FROM``: json.dumps of a flat list is C, where psycopg dumped array parameters
# element by element (half the client CPU of a 1,000-point batch), a record per point cost
# a dict each, and SQLAlchemy would compile a 7-parameters-per-row VALUES list anew for
# every batch. ``latest_metrics`` is
# merged as in ``_merge_latest``: a name's entry is replaced only by a later step (a repeated
# step keeps its first value, as the metrics table does). The points inserted go on into their
# rollup buckets (``rollups.PG_ROLLUP_CTE``) in the same statement.
_PG_RECORD = text(
    "WITH job AS (SELECT attempt, state, latest_metrics, metric_window_at, metric_window_points "
    "FROM jobs WHERE id = :job_id FOR UPDATE), "
    # The quotas, read from the locked row: names stored (latest_metrics holds one entry per
    # name with a current point) and new in this batch, and the points of the current window.
    "lm AS (SELECT CASE WHEN json_typeof(job.latest_metrics) = 'object' "
    "THEN job.latest_metrics::jsonb ELSE '{}'::jsonb END AS m, "
    "CASE WHEN job.metric_window_at > :window_start "
    "THEN COALESCE(job.metric_window_points, 0) ELSE 0 END AS window_points FROM job), "
    "room AS (SELECT (SELECT count(*) FROM jsonb_object_keys(lm.m)) AS stored_names, "
    "(SELECT count(*) FROM json_array_elements_text(CAST(:names AS json)) AS n(name) "
    "WHERE NOT jsonb_exists(lm.m, n.name)) AS new_names, lm.window_points FROM lm), "
    "ok AS (SELECT FROM job, room WHERE job.attempt = :attempt "
    "AND job.state = ANY(" + _PG_ACTIVE + ") "
    "AND (room.new_names = 0 OR room.stored_names + room.new_names <= :max_names) "
    "AND (:n = 0 OR room.window_points + :n <= :per_minute)), "
    "ins AS (INSERT INTO metrics (job_id, name, step, attempt, epoch, value, time, ranks) "
    "SELECT :job_id, u.n, u.s::bigint, :attempt, u.e::integer, u.v::float8, u.t::timestamptz, "
    "u.r::smallint FROM ROWS FROM (json_array_elements_text(CAST(:p_names AS json)), "
    "json_array_elements_text(CAST(:p_steps AS json)), "
    "json_array_elements_text(CAST(:p_epochs AS json)), "
    "json_array_elements_text(CAST(:p_values AS json)), "
    "json_array_elements_text(CAST(:p_times AS json)), "
    "json_array_elements_text(CAST(:p_ranks AS json))) AS u(n, s, e, v, t, r) "
    "WHERE EXISTS (SELECT FROM ok) "
    "ON CONFLICT DO NOTHING RETURNING name, step, value), " + PG_ROLLUP_CTE + ", "
    "upd AS (UPDATE jobs SET updated_at = :now, "
    "progress = CASE WHEN :set_progress THEN CAST(:progress AS json) ELSE jobs.progress END, "
    "metric_window_at = CASE WHEN jobs.metric_window_at > :window_start "
    "THEN jobs.metric_window_at ELSE :now END, "
    "metric_window_points = (SELECT window_points FROM room) + (SELECT count(*) FROM ins), "
    "latest_metrics = ((SELECT m FROM lm) || COALESCE((SELECT jsonb_object_agg(n.key, n.value) "
    "FROM lm, jsonb_each(CAST(:newest AS jsonb)) AS n "
    "WHERE COALESCE((lm.m->n.key->>'step')::bigint, -1) < (n.value->>'step')::bigint), "
    "'{}'))::json "
    "WHERE jobs.id = :job_id AND EXISTS (SELECT FROM ok)) "
    "SELECT job.attempt, job.state, (SELECT count(*) FROM ins) AS inserted, "
    "EXISTS (SELECT FROM ok) AS taken, room.stored_names, room.new_names, room.window_points, "
    "job.metric_window_at FROM job, room"
).columns(
    # Declared, so SQLAlchemy keeps the result's column map with the compiled statement
    # instead of building it from the cursor's description on every batch.
    *(column(c) for c in ("attempt", "state", "inserted", "taken", "stored_names")),
    *(column(c) for c in ("new_names", "window_points", "metric_window_at")),
)
# SQLite: one cached INSERT OR IGNORE run as executemany (sqlite3 sums rowcount over rows).
_SQLITE_INSERT_POINTS = sqlite.insert(Metric).on_conflict_do_nothing()


def _points_params(points: Sequence[CheckedPoint]) -> dict[str, list[Any]]:
    """Checked points (``checked_point``) as columns: ``names``, ``steps``, ``epochs``,
    ``values`` (None for NaN), ``times`` (a point without one gets now) and ``ranks``."""
    now = utcnow()
    return {
        "names": [p.name for p in points],
        "steps": [p.step for p in points],
        "epochs": [p.epoch for p in points],
        "values": [None if math.isnan(p.value) else p.value for p in points],
        "times": [p.time or now for p in points],
        "ranks": [p.ranks for p in points],
    }


def _columns_params(cols: CheckedColumns) -> dict[str, str]:
    """Checked columns as the JSON text parameters ``_PG_RECORD`` reads (``p_names`` …
    ``p_ranks``): NaN → null, ±inf → "±Infinity" (PostgreSQL's float8 input reads both),
    times as ISO 8601 UTC (a point without one gets now)."""
    now = utcnow()
    iso: dict[datetime, str] = {}  # a flush may stamp many points alike: format each once
    times = []
    for at in cols.times:
        at = at or now
        text_at = iso.get(at)
        if text_at is None:
            text_at = iso[at] = at.isoformat()
        times.append(text_at)
    values: list[Any] = cols.values
    if not math.isfinite(sum(values)):  # a NaN or an infinity somewhere: spell those out
        values = [json_safe(v) for v in values]
    dumps = json.dumps
    return {
        "p_names": dumps(cols.names),
        "p_steps": dumps(cols.steps),
        "p_epochs": dumps(cols.epochs),
        "p_values": dumps(values, allow_nan=False),
        "p_times": dumps(times),
        "p_ranks": dumps(cols.ranks),
    }


def _insert_points_sqlite(
    session: Session, job_id: int, attempt: int, points: Sequence[CheckedPoint]
) -> int:
    """Insert ``points`` of the fenced attempt (duplicates ignored) as one executemany; the
    number of rows inserted. The caller fenced the attempt (``leases.lock_attempt``).

    Raises:
        ValueError: a naive point ``time``.
    """
    cols = _points_params(points)
    rows = [
        {"job_id": job_id, "attempt": attempt, "name": n, "step": s, "epoch": e}
        | {"value": v, "time": t, "ranks": r}
        for n, s, e, v, t, r in zip(*cols.values(), strict=True)
    ]
    result = session.connection().execute(_SQLITE_INSERT_POINTS, rows)
    return int(cast(CursorResult[Any], result).rowcount)


def _sqlite_value(value: float) -> float | None:
    return None if math.isnan(value) else value


def _unstored(session: Session, job_id: int, points: Sequence[CheckedPoint]) -> list[CheckedPoint]:
    """``points`` whose (name, step) the job has not stored yet, each (name, step) once (the
    batch's first, as INSERT OR IGNORE keeps it): what the rollups may count. The caller
    holds SQLite's write lock, so nothing lands between this read and the insert."""
    if not points:
        return []
    steps = [p.step for p in points]
    rows = session.execute(
        select(Metric.name, Metric.step).where(
            Metric.job_id == job_id,
            Metric.name.in_({p.name for p in points}),
            Metric.step.between(min(steps), max(steps)),
        )
    ).all()
    stored = {(str(name), int(step)) for name, step in rows}
    fresh = []
    for p in points:
        key = (p.name, p.step)
        if key not in stored:
            stored.add(key)
            fresh.append(p)
    return fresh


def _newest(cols: CheckedColumns) -> dict[str, dict[str, Any]]:
    """Each name's newest point of the batch as a ``latest_metrics`` entry."""
    newest: dict[str, tuple[int, float]] = {}
    for name, step, value in zip(cols.names, cols.steps, cols.values, strict=True):
        prev = newest.get(name)
        if prev is None or step > prev[0]:  # a repeated step: the table keeps the first
            newest[name] = (step, value)
    return {n: {"step": int(s), "value": json_safe(v)} for n, (s, v) in newest.items()}


def _merge_latest(stored: Any, newest: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``stored`` latest_metrics with ``newest`` merged in: a name's entry is replaced only by
    a later step; a repeated step keeps its first value, as the metrics table does (the SQL of
    ``_PG_RECORD`` does the same)."""
    latest = dict(stored) if isinstance(stored, dict) else {}
    for name, entry in newest.items():
        prev = latest.get(name)
        if not isinstance(prev, dict) or int(prev.get("step", -1)) < entry["step"]:
            latest[name] = entry
    return latest


def _json_progress(progress: dict[str, Any]) -> dict[str, Any]:
    # NaN/inf (e.g. samples_per_s at a zero interval) is not valid JSON on PostgreSQL.
    return {k: json_safe(v) if isinstance(v, float) else v for k, v in progress.items()}


def record_metrics(
    session: Session,
    job_id: int,
    attempt: int,
    points: Sequence[CheckedPoint] | CheckedColumns,
    *,
    progress: dict[str, Any] | None = None,
    quotas: MetricQuotas | None = None,
) -> int:
    """Insert ``points`` for the current attempt; duplicates of (job, name, step) are ignored.

    ``points`` are ``CheckedPoint``s (built by ``metric_points.checked_point``) or checked
    columns (``metric_columns.CheckedColumns``, the API's), so both databases store them
    alike. Callers outside the type checker's reach (scripts, tests) may
    still hand plain ``MetricPoint``s: those are checked here, so both databases refuse the
    same points with the same error (a refused batch stores nothing); a ``CheckedPoint``
    passes through as it is.
    Also merges each name's newest value into ``jobs.latest_metrics`` and, when given,
    replaces ``jobs.progress`` (``{step, total_steps, epoch, samples_per_s, eta_s}``), and
    adds the points inserted to their rollup buckets (``rollups``). The fence, the quotas,
    the insert, the rollups and the job update run in the caller's transaction: one statement
    on PostgreSQL (so ``Database.session(one_statement=True)`` may run it), up to six on
    SQLite.

    ``quotas``: a batch that would bring the job past ``max_names`` names, or its window
    past ``per_minute`` points, is refused whole (nothing stored, progress included): a
    batch is stored entirely or not at all, so the rank's resend keeps each point once.
    The window counts the points stored (a resent duplicate counts nothing).

    Returns:
        The number of rows actually inserted.
    Raises:
        StaleAttemptError / NotFoundError: see ``leases.check_attempt``.
        QuotaExceededError: over a quota (422 names, 429 rate with ``retry_after_s``).
        ValueError: a point neither database could store alike (see ``checked_point``).
    """
    checked: list[CheckedPoint] | None = None
    if isinstance(points, CheckedColumns):
        cols = points
    else:
        checked = [checked_point(p) for p in points]  # a CheckedPoint: returned as it is
        cols = columns_of_points(checked)
    newest = _newest(cols)
    limits = quotas or MetricQuotas(max_names=2**62, per_minute=2**62)
    now = utcnow()
    if session.get_bind().dialect.name == "postgresql":
        params = {
            "job_id": job_id,
            "attempt": attempt,
            **_columns_params(cols),
            "now": now,
            "set_progress": progress is not None,
            "progress": json.dumps(_json_progress(progress)) if progress is not None else None,
            "newest": json.dumps(newest),
            "names": json.dumps(list(newest)),
            "n": len(cols),
            "max_names": limits.max_names,
            "per_minute": limits.per_minute,
            "window_start": window_start(now),
        }
        # On the session's connection: the ORM's execute adds nothing to a text statement.
        result = session.connection().execute(_PG_RECORD, params)
        row = fence_attempt(job_id, attempt, result.one_or_none())
        if not row.taken:
            refusal = quota_refusal(
                limits, stored_names=int(row.stored_names), new_names=int(row.new_names),
                window_points=int(row.window_points), window_at=row.metric_window_at,
                n=len(cols), now=now,
                stored_of_batch=lambda: names_stored(latest_metrics(session, job_id), newest),
            )  # fmt: skip
            assert refusal is not None  # the fence passed: only a quota refuses
            raise refusal
        return int(row.inserted)
    job = lock_attempt(session, job_id, attempt)
    window_at, window_points = session.execute(
        select(Job.metric_window_at, Job.metric_window_points).where(Job.id == job_id)
    ).one()
    if window_at is None or window_at <= window_start(now):
        window_at, window_points = now, 0
    stored = job.latest_metrics if isinstance(job.latest_metrics, dict) else {}
    refusal = quota_refusal(
        limits, stored_names=len(stored), new_names=len(set(newest) - set(stored)),
        window_points=int(window_points or 0), window_at=window_at, n=len(cols), now=now,
        stored_of_batch=lambda: names_stored(stored, newest),
    )  # fmt: skip
    if refusal is not None:
        raise refusal
    fresh = _unstored(session, job_id, checked if checked is not None else cols.points())
    inserted = _insert_points_sqlite(session, job_id, attempt, fresh) if fresh else 0
    add_points(session, job_id, ((p.name, p.step, _sqlite_value(p.value)) for p in fresh))
    values: dict[str, Any] = {"updated_at": now}
    if newest:
        values["latest_metrics"] = _merge_latest(job.latest_metrics, newest)
    if progress is not None:
        values["progress"] = _json_progress(progress)
    if inserted:
        values["metric_window_at"] = window_at
        values["metric_window_points"] = int(window_points or 0) + inserted
    if len(values) > 1:
        session.execute(update(Job).where(Job.id == job_id).values(**values))
    return inserted


def metric_names(session: Session, job_id: int) -> list[str]:
    """Names of the metrics a job has reported, sorted."""
    return list(
        session.scalars(
            select(Metric.name).where(Metric.job_id == job_id).distinct().order_by(Metric.name)
        )
    )


# What a reader of points gets (``values.PointRow``): plain rows, not ORM objects.
POINT_COLUMNS = (
    Metric.step, Metric.epoch, Metric.value, Metric.time, Metric.attempt, Metric.ranks,
)  # fmt: skip


def query_points(
    session: Session,
    job_id: int,
    name: str,
    *,
    after_step: int = 0,
    limit: int = METRIC_PAGE_POINTS,
    to_step: int | None = None,
) -> tuple[list[PointRow], int]:
    """Points of ``name`` with ``step > after_step`` (and ``≤ to_step`` when given),
    ascending, at most ``limit``.

    On PostgreSQL an index-only scan of the metrics primary key (it includes every column).

    Returns:
        ``(points, next_after_step)``: pass ``next_after_step`` back to continue; it equals
        ``after_step`` when nothing new has arrived.
    """
    # On the session's connection: a Core execution skips the ORM's result loading, which
    # cost as much as the query itself for 1,000 plain rows (profiled on the metrics poll).
    # ``.all()``: one fetchall (iterating the result fetched row by row, 6 µs each).
    where = [Metric.job_id == job_id, Metric.name == name, Metric.step > after_step]
    if to_step is not None:
        where.append(Metric.step <= to_step)
    stmt = select(*POINT_COLUMNS).where(*where).order_by(Metric.step).limit(limit)
    rows: list[PointRow] = list(session.connection().execute(stmt).all())
    return rows, (rows[-1].step if rows else after_step)


def downsample_points(
    session: Session, job_id: int, name: str, *, max_points: int
) -> list[PointRow]:
    """The whole history of ``name`` in at most ``max_points`` points, ascending by step.

    The first and the last point always stay (a curve ends at the newest value). The steps
    between are cut into ``(max_points - 2) // 2`` equal-width buckets; each bucket keeps the
    points holding its minimum and its maximum value (M4-style min/max decimation, so spikes
    and the global extremes survive). Histories of ``max_points`` or fewer come back whole.
    """
    lo, hi, count = session.execute(
        select(func.min(Metric.step), func.max(Metric.step), func.count()).where(
            Metric.job_id == job_id, Metric.name == name
        )
    ).one()
    if not count:
        return []
    if count <= max_points:
        return query_points(session, job_id, name, after_step=lo - 1, limit=count)[0]
    buckets = max(1, (max_points - 2) // 2)
    width = (hi - lo) // buckets + 1
    bucket = ((Metric.step - lo) // width).label("bucket")
    ranked = (
        select(
            Metric.step,
            func.row_number()
            .over(partition_by=bucket, order_by=(Metric.value.asc().nulls_last(), Metric.step))
            .label("rn_min"),
            func.row_number()
            .over(partition_by=bucket, order_by=(Metric.value.desc().nulls_last(), Metric.step))
            .label("rn_max"),
        )
        .where(Metric.job_id == job_id, Metric.name == name)
        .subquery()
    )
    ends = (ranked.c.step == lo) | (ranked.c.step == hi)
    extremes = (ranked.c.rn_min == 1) | (ranked.c.rn_max == 1)
    keep = select(ranked.c.step).where(ends | extremes if max_points >= 4 else ends)
    # Two statements on purpose: as one ``step IN (subquery)``, PostgreSQL (stale statistics
    # right after a bulk ingest) may re-run the window query per row: minutes for 100k points.
    steps = list(session.scalars(keep))
    return list(
        session.execute(
            select(*POINT_COLUMNS)
            .where(and_(Metric.job_id == job_id, Metric.name == name, Metric.step.in_(steps)))
            .order_by(Metric.step)
        )
    )
