"""The ``job_attempts`` rows: what rank 0 told about its attempt (resume step, restore time,
first step, checkpoint stall), written through the attempt API's timeline route."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.store.attempts.values import TimelineUpdate
from service.store.metrics.history import supersede_after_resume
from service.store.models import JobAttempt
from service.store.workers.leases import check_attempt


def record_attempt_timeline(
    session: Session, job_id: int, attempt: int, update: TimelineUpdate
) -> int:
    """Store ``update`` for ``(job_id, attempt)`` behind the attempt fence. The first
    ``resume_step`` told supersedes earlier attempts' points of later steps
    (``metric_history.supersede_after_resume``) in the same transaction.

    Returns:
        How many points were superseded now (0 unless this told the resume step first).
    Raises:
        NotFoundError / StaleAttemptError: see ``leases.check_attempt`` (nothing stored).
    """
    check_attempt(session, job_id, attempt)  # row-locked: a requeue (and old ranks) wait
    row = session.get(JobAttempt, (job_id, attempt))
    if row is None:
        row = JobAttempt(job_id=job_id, attempt=attempt)
        session.add(row)
    moved = 0
    if update.resume_step is not None and row.resume_step is None:
        row.resume_step = update.resume_step
        moved = supersede_after_resume(session, job_id, attempt, update.resume_step)
    for field in ("restore_s", "training_started_at", "checkpoint_stall_s", "checkpoint_saves"):
        value = getattr(update, field)
        if value is not None:
            setattr(row, field, value)
    return moved


def list_attempt_timelines(session: Session, job_id: int) -> dict[int, JobAttempt]:
    """The job's ``job_attempts`` rows by attempt."""
    rows = session.scalars(select(JobAttempt).where(JobAttempt.job_id == job_id))
    return {r.attempt: r for r in rows}
