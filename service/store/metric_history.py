"""Metric history across attempts: a resumed attempt's points supersede earlier attempts' points
of the steps it trains again, and the superseded ones stay queryable.

The rule (DESIGN.md: "one current point per (job_id, name, step), superseded ones kept
apart"): when attempt n tells its resume step S (``POST /attempts/self/timeline``,
``service.store.attempt_timeline``), every point of an earlier attempt with ``step > S`` moves
from ``metrics`` to ``metrics_superseded``, in the transaction that holds the job's row lock
(the attempt fence), so no point of an older attempt can land afterwards (their tokens are
fenced off) and attempt n's own points then insert as new. Within one attempt a repeated
step keeps its first value (``record_metrics``'s ON CONFLICT DO NOTHING). The dashboard poll
reads ``metrics`` alone: no join on its path.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, TypeAlias, cast

from sqlalchemy import CursorResult, Row, delete, insert, literal, select, update
from sqlalchemy.orm import Session

from service.core.metric_points import json_safe
from service.store.models import Job, Metric, MetricSuperseded

_MOVED_COLUMNS = ("job_id", "name", "step", "attempt", "epoch", "value", "time", "ranks")

# A superseded point as readers get it: ``.step``, ``.epoch``, ``.value``, ``.time``,
# ``.attempt``, ``.ranks`` (as ``metrics.PointRow``) and ``.superseded_by``.
SupersededRow: TypeAlias = "Row[int, int | None, float | None, datetime, int, int | None, int]"


def supersede_after_resume(session: Session, job_id: int, attempt: int, resume_step: int) -> int:
    """Move the points earlier attempts stored for steps after ``resume_step`` to
    ``metrics_superseded`` (``superseded_by = attempt``) and roll ``jobs.latest_metrics``
    back to the newest remaining point of each name. Idempotent: a second call moves nothing.

    Call it only behind the attempt fence (``leases.check_attempt``, the job's row lock), in
    the caller's transaction.

    Returns:
        How many points moved.
    """
    moved_where = (Metric.job_id == job_id, Metric.step > resume_step, Metric.attempt < attempt)
    source = select(
        *(getattr(Metric, c) for c in _MOVED_COLUMNS), literal(attempt).label("superseded_by")
    ).where(*moved_where)
    session.execute(
        insert(MetricSuperseded).from_select([*_MOVED_COLUMNS, "superseded_by"], source)
    )
    result = session.execute(
        delete(Metric).where(*moved_where).execution_options(synchronize_session=False)
    )
    moved = cast(CursorResult[Any], result).rowcount
    if moved:
        _roll_back_latest(session, job_id, resume_step)
    return int(moved or 0)


def _roll_back_latest(session: Session, job_id: int, resume_step: int) -> None:
    """``latest_metrics`` entries of steps after ``resume_step`` replaced by each name's newest
    current point (dropped when none is left)."""
    stored = session.scalar(select(Job.latest_metrics).where(Job.id == job_id))
    latest: dict[str, Any] = dict(stored) if isinstance(stored, dict) else {}
    changed = False
    for name, entry in list(latest.items()):
        if isinstance(entry, dict) and int(entry.get("step", 0)) <= resume_step:
            continue
        changed = True
        row = session.execute(
            select(Metric.step, Metric.value)
            .where(Metric.job_id == job_id, Metric.name == name)
            .order_by(Metric.step.desc())
            .limit(1)
        ).one_or_none()
        if row is None:
            del latest[name]
        else:
            latest[name] = {"step": int(row.step), "value": json_safe(row.value)}
    if changed:
        session.execute(update(Job).where(Job.id == job_id).values(latest_metrics=latest))


def query_superseded(
    session: Session, job_id: int, name: str, *, after_step: int = 0, to_step: int | None = None
) -> list[SupersededRow]:
    """Superseded points of ``name`` with ``after_step < step <= to_step`` (no upper bound
    when ``to_step`` is None), ascending by step, then attempt."""
    cond = [
        MetricSuperseded.job_id == job_id,
        MetricSuperseded.name == name,
        MetricSuperseded.step > after_step,
    ]
    if to_step is not None:
        cond.append(MetricSuperseded.step <= to_step)
    s = MetricSuperseded
    stmt = (
        select(s.step, s.epoch, s.value, s.time, s.attempt, s.ranks, s.superseded_by)
        .where(*cond)
        .order_by(s.step, s.attempt)
    )
    return list(session.connection().execute(stmt).all())
