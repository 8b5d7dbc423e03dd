"""Metric use cases: a rank's batch in (the ingest), a job's points out (the dashboard's poll,
downsampled history), each owning its transaction and returning plain values (``values``).

Both are hot paths and stay as lean as the measurements made them: the ingest is one
autocommit statement on PostgreSQL, run on the driver's connection (``pg_ingest``); the poll
reads plain Core rows (``values.PointRow``), handed out as they come.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from service.core.metrics.points import MAX_STEP, CheckedPoint, checked_point
from service.core.owners.quotas import MetricQuotas, QuotaExceededError
from service.core.wire.metric_columns import CheckedColumns, columns_of_points
from service.store.attempts.fence import superseded_on_fence
from service.store.attempts.values import AttemptRef
from service.store.db import Database
from service.store.jobs.crud import get_job
from service.store.metrics import pg_ingest
from service.store.metrics.curves import curve
from service.store.metrics.history import downsample_superseded, history_page
from service.store.metrics.points import (
    metric_names,
    newest_entries,
    query_points,
    record_metrics,
)
from service.store.metrics.quotas import check_batch_size
from service.store.metrics.values import MetricPage
from service.store.quotas import record_quota_hit
from service.store.workers.leases import check_attempt


def record_batch(
    db: Database,
    ref: AttemptRef,
    points: Sequence[CheckedPoint] | CheckedColumns,
    *,
    progress: dict[str, Any] | None,
    quotas: MetricQuotas | None = None,
) -> int:
    """Store a rank's batch of checked points (or checked columns) and, when given, the
    job's progress snapshot, in one fenced write (one autocommit statement on PostgreSQL).
    Idempotent per (job, name, step). ``quotas``: the job's metric names and points per
    minute; a batch over one is refused whole, and the job gets a ``quota_exceeded`` event
    (once per attempt and quota).

    Returns:
        The number of points inserted (0 for a resent batch).
    Raises:
        StaleAttemptError: the attempt is superseded (409, nothing stored).
        QuotaExceededError: over a metric quota (422 names or a batch bigger than the rate;
            429 with ``retry_after_s`` for the rate), nothing stored.
    """
    try:
        if quotas is not None:
            check_batch_size(len(points), quotas)
        if db.on_psycopg:
            cols = points
            if not isinstance(cols, CheckedColumns):  # a CheckedPoint passes through as it is
                cols = columns_of_points([checked_point(p) for p in cols])
            with superseded_on_fence():
                batch = pg_ingest.IngestBatch(ref.job_id, ref.attempt, cols, newest_entries(cols),
                                              progress, quotas or pg_ingest.NO_LIMITS)  # fmt: skip
                return pg_ingest.record_on_driver(db, batch)
        with superseded_on_fence(), db.session() as session:
            return record_metrics(session, ref.job_id, ref.attempt, points, progress=progress,
                                  quotas=quotas)  # fmt: skip
    except QuotaExceededError as exc:
        with superseded_on_fence(), db.session() as session:
            check_attempt(session, ref.job_id, ref.attempt)  # row-locked: one note
            record_quota_hit(session, ref.job_id, ref.attempt, exc.hit)
        raise


async def record_columns_on_loop(
    db: Database,
    ref: AttemptRef,
    cols: CheckedColumns,
    *,
    progress: dict[str, Any] | None,
    quotas: MetricQuotas | None = None,
) -> int | None:
    """``record_batch`` of checked columns as one statement awaited on the running event
    loop (``db.loop_pool``, PostgreSQL only): the number of points inserted, when the
    statement took the batch. None when it did not: no loop pool here, a driver error, or a
    refusal (the fence, a quota; nothing of the batch was stored). The caller then calls
    ``record_batch`` (in a thread), which stores it or raises the refusal's error and
    records a quota's event, so a client sees the same answers either way."""
    pool = db.loop_pool
    if pool is None:
        return None
    if quotas is not None:
        try:
            check_batch_size(len(cols), quotas)
        except QuotaExceededError:
            return None  # record_batch raises it and records its event
    batch = pg_ingest.IngestBatch(ref.job_id, ref.attempt, cols, newest_entries(cols), progress,
                                  quotas or pg_ingest.NO_LIMITS)  # fmt: skip
    return await pg_ingest.record_on_loop(pool, batch)


def read_metric_page(
    db: Database,
    job_id: int,
    name: str,
    *,
    owner: str | None,
    after_step: int,
    limit: int,
    max_points: int | None,
    include_superseded: bool,
    cap: int,
    from_step: int = 1,
    to_step: int = MAX_STEP,
) -> MetricPage:
    """Points of ``name`` with ``step > after_step``, at most ``limit``; or, with
    ``max_points``, the steps ``from_step..to_step`` (the chart's zoom; default the whole
    history) min/max-decimated to that many from the rollups (``curves.curve``;
    ``after_step`` and ``limit`` ignored). ``include_superseded`` adds the points of earlier
    attempts that a resumed attempt trained again (sharing the page's limit and cursor; with
    ``max_points``, their whole history decimated at read time). ``cap``
    (``DDPQ_MAX_METRIC_POINTS``) bounds ``limit`` and ``max_points``. Without ``max_points``,
    ``from_step``/``to_step`` bound the page too.

    Raises:
        NotFoundError: no job ``job_id`` of ``owner`` (None: any owner).
    """
    with db.session(write=False) as session:
        get_job(session, job_id, owner=owner)
        if max_points is not None:
            rows = curve(session, job_id, name, max_points=min(max_points, cap),
                         from_step=from_step, to_step=to_step)  # fmt: skip
            next_after = rows[-1].step if rows else after_step
            old = None
            if include_superseded:
                old = downsample_superseded(session, job_id, name, max_points=min(max_points, cap))
            return MetricPage(name, rows, old, next_after)
        after_step = max(after_step, from_step - 1)
        if not include_superseded:
            rows, next_after = query_points(session, job_id, name, after_step=after_step,
                                            limit=min(limit, cap), to_step=to_step)  # fmt: skip
            return MetricPage(name, rows, None, next_after)
        # Both kinds share the page's limit; the cursor continues through both.
        rows, old, next_after = history_page(
            session, job_id, name, after_step=after_step, limit=min(limit, cap)
        )
        return MetricPage(name, rows, old, next_after)


def list_metric_names(db: Database, job_id: int, *, owner: str | None) -> list[str]:
    """Every metric name job ``job_id`` reported, sorted.

    Raises:
        NotFoundError: no job ``job_id`` of ``owner`` (None: any owner).
    """
    with db.session(write=False) as session:
        get_job(session, job_id, owner=owner)
        return metric_names(session, job_id)
