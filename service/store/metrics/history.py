"""Metric history across attempts: a resumed attempt's points supersede earlier attempts' points
of the steps it trains again, and the superseded ones stay queryable.

The rule (DESIGN.md: "one current point per (job_id, name, step), superseded ones kept
apart"): when attempt n tells its resume step S (``POST /attempts/self/timeline``,
``service.store.attempts.timeline``), every point of an earlier attempt with ``step > S`` moves
from ``metrics`` to ``metrics_superseded``, in the transaction that holds the job's row lock
(the attempt fence), so no point of an older attempt can land afterwards (their tokens are
fenced off) and attempt n's own points then insert as new. Within one attempt a repeated
step keeps its first value (``record_metrics``'s ON CONFLICT DO NOTHING). The dashboard poll
reads ``metrics`` alone: no join on its path.
"""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import CursorResult, delete, func, insert, literal, select, update
from sqlalchemy.orm import Session

from service.core.metrics.points import json_safe
from service.store.metrics import rollups
from service.store.metrics.points import query_points
from service.store.metrics.quotas import latest_metrics
from service.store.metrics.values import PointRow, SupersededRow
from service.store.models import Job, Metric, MetricSuperseded

_MOVED_COLUMNS = ("job_id", "name", "step", "attempt", "epoch", "value", "time", "ranks")


def supersede_after_resume(session: Session, job_id: int, attempt: int, resume_step: int) -> int:
    """Move the points earlier attempts stored for steps after ``resume_step`` to
    ``metrics_superseded`` (``superseded_by = attempt``), rebuild those names' rollup buckets
    from ``resume_step + 1`` on, and roll ``jobs.latest_metrics`` back to the newest remaining
    point of each name. Idempotent: a second call moves nothing.

    Call it only behind the attempt fence (``leases.check_attempt``, the job's row lock), in
    the caller's transaction.

    Returns:
        How many points moved.
    """
    moved_where = (Metric.job_id == job_id, Metric.step > resume_step, Metric.attempt < attempt)
    source = select(
        *(getattr(Metric, c) for c in _MOVED_COLUMNS), literal(attempt).label("superseded_by")
    ).where(*moved_where)
    names = list(session.scalars(select(Metric.name).where(*moved_where).distinct()))
    if not names:
        return 0
    session.execute(
        insert(MetricSuperseded).from_select([*_MOVED_COLUMNS, "superseded_by"], source)
    )
    result = session.execute(
        delete(Metric).where(*moved_where).execution_options(synchronize_session=False)
    )
    moved = cast(CursorResult[Any], result).rowcount
    for name in names:
        rollups.rebuild(session, job_id, name, from_step=resume_step + 1)
    _roll_back_latest(session, job_id, resume_step)
    return int(moved or 0)


def _roll_back_latest(session: Session, job_id: int, resume_step: int) -> None:
    """``latest_metrics`` entries of steps after ``resume_step`` replaced by each name's newest
    current point (dropped when none is left)."""
    latest = dict(latest_metrics(session, job_id))
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


def history_page(
    session: Session, job_id: int, name: str, *, after_step: int, limit: int
) -> tuple[list[PointRow], list[SupersededRow], int]:
    """One page of ``name``'s current and superseded points with ``step > after_step``: at
    most ``limit`` points of both kinds together, whole steps only (a step's points never
    straddle two pages; a single step with more points than ``limit`` comes whole).

    Returns:
        ``(current, superseded, next_after_step)``: pass ``next_after_step`` back for the
        next page; every point of either kind up to it is in this page or an earlier one
        (it equals ``after_step`` when there is nothing after it).
    """
    rows, _ = query_points(session, job_id, name, after_step=after_step, limit=limit)
    # The page ends where either kind could run on: the last current step of a full page,
    # the step of the limit-th superseded point.
    ends = [rows[-1].step] if len(rows) == limit else []
    s = MetricSuperseded
    nth = session.scalar(
        select(s.step)
        .where(s.job_id == job_id, s.name == name, s.step > after_step)
        .order_by(s.step, s.attempt)
        .offset(limit - 1)
        .limit(1)
    )
    if nth is not None:
        ends.append(int(nth))
    hi = min(ends) if ends else None
    old = query_superseded(session, job_id, name, after_step=after_step, to_step=hi)
    rows = [r for r in rows if hi is None or r.step <= hi]
    steps = sorted([r.step for r in rows] + [r.step for r in old])
    if len(steps) > limit:
        # Cut before the first step that does not fit whole (but keep at least one step).
        cut = steps[limit]
        kept = [st for st in steps if st < cut]
        hi = kept[-1] if kept else cut
        rows = [r for r in rows if r.step <= hi]
        old = [r for r in old if r.step <= hi]
    elif hi is None:
        hi = steps[-1] if steps else after_step
    return rows, old, hi


def downsample_superseded(
    session: Session, job_id: int, name: str, *, max_points: int
) -> list[SupersededRow]:
    """``name``'s superseded points in at most about ``max_points`` points, ascending by step
    then attempt, decimated as ``metrics.downsample_points`` does (first and last point and
    each bucket's minimum and maximum), per superseded attempt: each keeps its own shape."""
    s = MetricSuperseded
    where = (s.job_id == job_id, s.name == name)
    lo, hi, count, attempts = session.execute(
        select(func.min(s.step), func.max(s.step), func.count(), func.count(s.attempt.distinct()))
        .where(*where)
    ).one()  # fmt: skip
    if count <= max_points:
        return query_superseded(session, job_id, name, after_step=-1)
    buckets = max(1, (max_points - 2 * attempts) // (2 * attempts))
    width = (hi - lo) // buckets + 1
    part = (s.attempt, (s.step - lo) // width)
    low, high = (s.value.asc().nulls_last(), s.step), (s.value.desc().nulls_last(), s.step)
    ranked = (
        select(
            s.step,
            s.attempt,
            func.row_number().over(partition_by=part, order_by=low).label("rn_min"),
            func.row_number().over(partition_by=part, order_by=high).label("rn_max"),
            func.min(s.step).over(partition_by=s.attempt).label("first"),
            func.max(s.step).over(partition_by=s.attempt).label("last"),
        )
        .where(*where)
        .subquery()
    )
    c = ranked.c
    keep = (c.step == c.first) | (c.step == c.last)
    if max_points >= 4:
        keep = keep | (c.rn_min == 1) | (c.rn_max == 1)
    wanted = {(int(st), int(a)) for st, a in session.execute(select(c.step, c.attempt).where(keep))}
    # Two statements, as in ``downsample_points``; the kept steps' rows, then the kept pairs.
    stmt = (
        select(s.step, s.epoch, s.value, s.time, s.attempt, s.ranks, s.superseded_by)
        .where(*where, s.step.in_(sorted({st for st, _ in wanted})))
        .order_by(s.step, s.attempt)
    )
    rows = session.connection().execute(stmt).all()
    return [r for r in rows if (r.step, r.attempt) in wanted]
