"""Metric ingest (duplicate-safe, fenced by attempt), progress, and metric queries."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import CursorResult, and_, func, select, update
from sqlalchemy.dialects import sqlite
from sqlalchemy.orm import Session

from service.core.limits import METRIC_PAGE_POINTS
from service.core.metrics.points import CheckedPoint, checked_point, json_safe
from service.core.metrics.points import MetricPoint as MetricPoint  # re-exported for callers
from service.core.owners.quotas import MetricQuotas
from service.core.wire.metric_columns import CheckedColumns, columns_of_points
from service.store.metrics import pg_ingest
from service.store.metrics.quotas import (
    latest_metrics,
    names_stored,
    quota_refusal,
    window_start,
)
from service.store.metrics.rollups import add_points
from service.store.metrics.values import PointRow
from service.store.models import Job, Metric, utcnow
from service.store.workers.leases import lock_attempt

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


def newest_entries(cols: CheckedColumns) -> dict[str, dict[str, Any]]:
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
    newest = newest_entries(cols)
    limits = quotas or pg_ingest.NO_LIMITS
    now = utcnow()
    if session.get_bind().dialect.name == "postgresql":
        batch = pg_ingest.IngestBatch(job_id, attempt, cols, newest, progress, limits)
        # On the session's connection: the ORM's execute adds nothing to a text statement.
        result = session.connection().execute(pg_ingest.PG_RECORD, pg_ingest.params(batch, now))
        return pg_ingest.outcome(
            result.one_or_none(), batch, now,
            lambda: names_stored(latest_metrics(session, job_id), newest),
        )  # fmt: skip
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
        values["progress"] = pg_ingest.json_progress(progress)
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
