"""Metric ingest (duplicate-safe, fenced by attempt), progress, and metric queries."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from service.errors import NotFoundError, StaleAttemptError
from service.models import Job, Metric, utcnow
from service.states import ACTIVE_STATES

JsonNumber = float | str | None


@dataclass(frozen=True)
class MetricPoint:
    """One reported scalar: ``name`` at global ``step`` (1-based), in ``epoch`` (0-based)."""

    name: str
    step: int
    value: float
    epoch: int | None = None
    time: datetime | None = None


def json_safe(value: float | None) -> JsonNumber:
    """A float as a JSON-valid value: finite → float, NaN/NULL → None, ±inf → "±Infinity"."""
    if value is None or math.isnan(value):
        return None
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return float(value)


def _insert(session: Session) -> Any:
    if session.get_bind().dialect.name == "postgresql":
        return postgresql.insert
    return sqlite.insert


def check_attempt(session: Session, job_id: int, attempt: int) -> Job:
    """Fence: the job must exist, hold ``attempt`` as its current attempt and be active.

    Takes the row lock on PostgreSQL so a concurrent requeue waits for this write.

    Raises:
        NotFoundError: no such job.
        StaleAttemptError: ``attempt`` is not current, or the job is not starting/running.
    """
    job = session.scalars(select(Job).where(Job.id == job_id).with_for_update()).one_or_none()
    if job is None:
        raise NotFoundError(f"job {job_id} not found")
    if job.attempt != attempt or job.state not in {s.value for s in ACTIVE_STATES}:
        raise StaleAttemptError(
            f"job {job_id} attempt {attempt} is stale (job is {job.state}, attempt {job.attempt})"
        )
    return job


def record_metrics(
    session: Session,
    job_id: int,
    attempt: int,
    points: list[MetricPoint],
    *,
    progress: dict[str, Any] | None = None,
) -> int:
    """Insert ``points`` for the current attempt; duplicates of (job, name, step) are ignored.

    Also merges each name's newest value into ``jobs.latest_metrics`` and, when given,
    replaces ``jobs.progress`` (``{step, total_steps, epoch, samples_per_s, eta_s}``).

    Returns:
        The number of rows actually inserted.
    Raises:
        StaleAttemptError / NotFoundError: see ``check_attempt``.
    """
    job = check_attempt(session, job_id, attempt)
    inserted = 0
    if points:
        now = utcnow()
        rows = [
            {
                "job_id": job_id,
                "name": p.name,
                "step": int(p.step),
                "attempt": attempt,
                "epoch": p.epoch,
                "value": None if math.isnan(p.value) else float(p.value),
                "time": p.time or now,
            }
            for p in points
        ]
        # Keep batches under SQLite's bound-parameter limit (7 columns per row).
        for i in range(0, len(rows), 1000):
            chunk = rows[i : i + 1000]
            stmt = (
                _insert(session)(Metric)
                .values(chunk)
                .on_conflict_do_nothing()
                .returning(Metric.step)
            )
            inserted += len(session.execute(stmt).all())
    latest = dict(job.latest_metrics or {})
    newest: dict[str, MetricPoint] = {}
    for p in points:
        if p.name not in newest or p.step >= newest[p.name].step:
            newest[p.name] = p
    for name, p in newest.items():
        prev = latest.get(name)
        if prev is None or int(prev.get("step", -1)) <= p.step:
            latest[name] = {"step": int(p.step), "value": json_safe(p.value)}
    values: dict[str, Any] = {"updated_at": utcnow()}
    if newest:
        values["latest_metrics"] = latest
    if progress is not None:
        # NaN/inf (e.g. samples_per_s at a zero interval) is not valid JSON on PostgreSQL.
        values["progress"] = {
            k: json_safe(v) if isinstance(v, float) else v for k, v in progress.items()
        }
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


def query_points(
    session: Session, job_id: int, name: str, *, after_step: int = 0, limit: int = 1000
) -> tuple[list[Metric], int]:
    """Points of ``name`` with ``step > after_step``, ascending, at most ``limit``.

    Returns:
        ``(points, next_after_step)``: pass ``next_after_step`` back to continue; it equals
        ``after_step`` when nothing new has arrived.
    """
    rows = list(
        session.scalars(
            select(Metric)
            .where(Metric.job_id == job_id, Metric.name == name, Metric.step > after_step)
            .order_by(Metric.step)
            .limit(limit)
        )
    )
    return rows, (rows[-1].step if rows else after_step)


def downsample_points(session: Session, job_id: int, name: str, *, max_points: int) -> list[Metric]:
    """The whole history of ``name`` in at most ``max_points`` points, ascending by step.

    Steps are cut into ``max_points // 2`` equal-width buckets; each bucket keeps the points
    holding its minimum and its maximum value (M4-style min/max decimation, so spikes and the
    global extremes survive). Histories of ``max_points`` or fewer come back whole.
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
    buckets = max(1, max_points // 2)
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
    keep = select(ranked.c.step).where((ranked.c.rn_min == 1) | (ranked.c.rn_max == 1))
    # Two statements on purpose: as one ``step IN (subquery)``, PostgreSQL (stale statistics
    # right after a bulk ingest) may re-run the window query per row: minutes for 100k points.
    steps = list(session.scalars(keep))
    return list(
        session.scalars(
            select(Metric)
            .where(and_(Metric.job_id == job_id, Metric.name == name, Metric.step.in_(steps)))
            .order_by(Metric.step)
        )
    )


def update_progress(session: Session, job_id: int, attempt: int, progress: dict[str, Any]) -> None:
    """Replace the job's progress snapshot (fenced on ``attempt``)."""
    record_metrics(session, job_id, attempt, [], progress=progress)
