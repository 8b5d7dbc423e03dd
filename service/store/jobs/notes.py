"""Job events that are not state changes, written by the worker for an active attempt: a note
for people (e.g. more ranks than cores) and a batch scheduler's pending reason, plus the read
of the newest pending reason that ``GET /jobs/{id}`` explains."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.core.pending_reasons import (
    PENDING_EVENT_PREFIX,
    parse_pending_event,
    pending_event_reason,
)
from service.store.jobs.queue import SchedulerPending
from service.store.models import JobEvent
from service.store.workers.leases import check_attempt

MAX_NOTE_CHARS = 2000


def record_job_note(
    session: Session, job_id: int, attempt: int, reason: str, *, worker_id: str | None = None
) -> None:
    """Add an event to the job's history without changing its state (from_state = to_state),
    fenced on ``attempt``, so ``ddpq show`` and ``GET /jobs/{id}/events`` show it.

    Raises:
        StaleAttemptError / NotFoundError: the attempt is not the job's current active one.
    """
    job = check_attempt(session, job_id, attempt)
    session.add(
        JobEvent(
            job_id=job_id,
            attempt=attempt,
            from_state=job.state,
            to_state=job.state,
            reason=reason[:MAX_NOTE_CHARS],
            worker_id=worker_id,
        )
    )


def latest_scheduler_pending(
    session: Session, job_id: int, attempt: int
) -> SchedulerPending | None:
    """The newest scheduler pending reason recorded for ``attempt`` of the job; None when a
    worker recorded none (two indexed reads at most: the job's events, newest first)."""
    row = session.execute(
        select(JobEvent.reason, JobEvent.created_at)
        .where(
            JobEvent.job_id == job_id,
            JobEvent.attempt == attempt,
            JobEvent.reason.startswith(PENDING_EVENT_PREFIX, autoescape=True),
        )
        .order_by(JobEvent.id.desc())
        .limit(1)
    ).one_or_none()
    code = parse_pending_event(row.reason) if row is not None else None
    return SchedulerPending(code, row.created_at) if row is not None and code else None


def record_scheduler_pending(
    session: Session,
    job_id: int,
    attempt: int,
    code: str,
    words: str,
    *,
    worker_id: str | None = None,
) -> bool:
    """Record the scheduler's pending reason ``code`` (explained as ``words``) for the
    attempt, unless it is the newest one already recorded (a worker restart records no
    duplicate).

    Returns:
        True when an event was written.
    Raises:
        StaleAttemptError / NotFoundError: the attempt is not the job's current active one.
    """
    newest = latest_scheduler_pending(session, job_id, attempt)
    if newest is not None and newest.code == code:
        return False
    record_job_note(
        session, job_id, attempt, pending_event_reason(code, words), worker_id=worker_id
    )
    return True
