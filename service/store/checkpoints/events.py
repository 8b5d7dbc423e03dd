"""Job events for what happens to checkpoints at resume, so ``ddpq show`` tells it and not
only the rank's log: a checkpoint rank 0 found damaged and deleted, and an attempt that starts
from step 0 although the job had checkpoints (all damaged or gone); plus rank 0's notes."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.core.events import EventKind
from service.store.events import events_of_kinds, record_event
from service.store.models import Checkpoint, Job
from service.store.workers.leases import check_attempt

# A rank's ``AttemptNote.kind`` → the event it is written as.
NOTE_KINDS = {
    "upload_fallback": EventKind.UPLOAD_FALLBACK,
    "nothing_to_train": EventKind.NOTHING_TO_TRAIN,
}


def _event(
    session: Session, job: Job, attempt: int, kind: EventKind, data: dict[str, object]
) -> None:
    record_event(session, job.id, attempt, kind, data, from_state=job.state, to_state=job.state)


def note_rank_deletions(
    session: Session, job: Job, attempt: int, steps: list[int], *, damaged: bool
) -> None:
    """One event per step rank 0 had marked deleted (``steps``: those really marked).

    Args:
        job: the job's row, as the fence returned it (row-locked by the caller).
        damaged: True: found damaged at resume (``checkpoint_damaged``); False: its file
            could not be put in place after the save was recorded (``checkpoint_unplaced``).
    """
    kind = EventKind.CHECKPOINT_DAMAGED if damaged else EventKind.CHECKPOINT_UNPLACED
    for step in sorted(steps):
        _event(session, job, attempt, kind, {"step": step})


def note_fresh_start(session: Session, job: Job, attempt: int) -> None:
    """When ``attempt`` starts from step 0 although earlier attempts recorded checkpoints,
    an event says so, naming the steps it found damaged ("attempt 2 starts from step 0: no
    intact checkpoint (step 65 damaged)"). Once per attempt; nothing for a first start."""
    had = session.scalar(
        select(Checkpoint.id)
        .where(Checkpoint.job_id == job.id, Checkpoint.attempt < attempt)
        .limit(1)
    )
    if had is None:
        return
    seen = events_of_kinds(
        session, job.id, attempt, (EventKind.FRESH_START, EventKind.CHECKPOINT_DAMAGED)
    )
    if any(e.kind == EventKind.FRESH_START for e in seen):
        return
    damaged = sorted({int(e.data["step"]) for e in seen if e.kind == EventKind.CHECKPOINT_DAMAGED})
    _event(
        session, job, attempt, EventKind.FRESH_START, {"attempt": attempt, "damaged_steps": damaged}
    )


def record_note(
    session: Session, job_id: int, attempt: int, kind: str, *, step: int | None,
    total_steps: int | None,
) -> None:  # fmt: skip
    """Write a rank's note (``kind`` as the wire allows: a key of ``NOTE_KINDS``) as a job
    event, behind the attempt fence; the same note twice in one attempt (a resend) is one
    event.

    Raises:
        StaleAttemptError / NotFoundError: the attempt is fenced off (nothing written).
    """
    job = check_attempt(session, job_id, attempt)
    event_kind = NOTE_KINDS[kind]
    data: dict[str, object] = {}
    if event_kind == EventKind.NOTHING_TO_TRAIN:
        data = {"step": step, "total_steps": total_steps}
    if all(e.data != data for e in events_of_kinds(session, job_id, attempt, (event_kind,))):
        _event(session, job, attempt, event_kind, data)
