"""Job events that are not state changes, written by the worker for an active attempt: a note
for people (e.g. more ranks than cores) and a batch scheduler's pending reason, plus the read
of the newest pending reason that ``GET /jobs/{id}`` explains."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.orm import Session

from service.core.events import EventKind
from service.core.pending_reasons import MAX_REASON_CODE_CHARS
from service.store.events import newest_event, record_event
from service.store.jobs.values import SchedulerPending
from service.store.workers.leases import check_attempt


def record_job_note(
    session: Session,
    job_id: int,
    attempt: int,
    kind: EventKind,
    data: Mapping[str, Any] | None = None,
    *,
    worker_id: str | None = None,
) -> None:
    """Add an event of ``kind`` (a note: ``service.core.events.NOTE_KINDS``) to the job's
    history without changing its state (from_state = to_state), fenced on ``attempt``, so
    ``ddpq show`` and ``GET /jobs/{id}/events`` show it.

    Raises:
        StaleAttemptError / NotFoundError: the attempt is not the job's current active one.
        KeyError: ``data`` lacks a field the kind's wording needs.
    """
    job = check_attempt(session, job_id, attempt)
    record_event(
        session, job_id, attempt, kind, data, from_state=job.state, to_state=job.state,
        worker_id=worker_id,
    )  # fmt: skip


def latest_scheduler_pending(
    session: Session, job_id: int, attempt: int
) -> SchedulerPending | None:
    """The newest scheduler pending reason recorded for ``attempt`` of the job; None when a
    worker recorded none (one read on the job's events of that kind)."""
    event = newest_event(session, job_id, attempt, EventKind.SCHEDULER_PENDING)
    code = event.data.get("code") if event is not None else None
    return SchedulerPending(str(code), event.created_at) if event is not None and code else None


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
    code = code[:MAX_REASON_CODE_CHARS]
    newest = latest_scheduler_pending(session, job_id, attempt)
    if newest is not None and newest.code == code:
        return False
    record_job_note(
        session, job_id, attempt, EventKind.SCHEDULER_PENDING, {"code": code, "words": words},
        worker_id=worker_id,
    )  # fmt: skip
    return True
