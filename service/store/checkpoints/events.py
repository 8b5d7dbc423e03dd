"""Job events for what happens to checkpoints at resume, so ``ddpq show`` tells it and not
only the rank's log: a checkpoint rank 0 found damaged and deleted, and an attempt that starts
from step 0 although the job had checkpoints (all damaged or gone)."""

from __future__ import annotations

import re

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.store.models import Checkpoint, Job, JobEvent
from service.store.workers.leases import check_attempt

_DAMAGED = "found damaged at resume and deleted"
_DAMAGED_STEP = re.compile(r"^checkpoint at step (\d+) " + re.escape(_DAMAGED))
_FRESH = "starts from step 0: no intact checkpoint"


def _event(session: Session, job: Job, attempt: int, reason: str) -> None:
    session.add(
        JobEvent(
            job_id=job.id,
            attempt=attempt,
            from_state=job.state,
            to_state=job.state,
            reason=reason[:2000],
        )
    )


def note_rank_deletions(
    session: Session, job: Job, attempt: int, steps: list[int], *, damaged: bool
) -> None:
    """One event per step rank 0 had marked deleted (``steps``: those really marked).

    Args:
        job: the job's row, as the fence returned it (row-locked by the caller).
        damaged: True: found damaged at resume; False: its file could not be put in place
            after the save was recorded.
    """
    for step in sorted(steps):
        why = _DAMAGED if damaged else "deleted: its file could not be put in place"
        _event(session, job, attempt, f"checkpoint at step {step} {why}")


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
    reasons = list(
        session.scalars(
            select(JobEvent.reason).where(JobEvent.job_id == job.id, JobEvent.attempt == attempt)
        )
    )
    if any(r and f"attempt {attempt} {_FRESH}" in r for r in reasons):
        return
    damaged = sorted(
        {int(m.group(1)) for r in reasons if r and (m := _DAMAGED_STEP.match(r)) is not None}
    )
    detail = ", ".join(f"step {s}" for s in damaged[:20]) + " damaged" if damaged else "none usable"
    _event(session, job, attempt, f"attempt {attempt} {_FRESH} ({detail})")


def note_text(kind: str, step: int | None, total_steps: int | None) -> str:
    """The job event for a rank's ``AttemptNote`` (``kind`` as the wire allows)."""
    if kind == "upload_fallback":
        return (
            "checkpoint transport: DDPQ_CHECKPOINT_TRANSPORT=shared, but rank 0's artifact "
            "root does not hold the API's store id (not the API's directory): uploading instead"
        )
    return (
        f"init_from step {step} ≥ this job's {total_steps} steps: nothing to train "
        "(raise training.max_steps or epochs, or use init_from.mode weights_only)"
    )


def record_note(
    session: Session, job_id: int, attempt: int, kind: str, *, step: int | None,
    total_steps: int | None,
) -> None:  # fmt: skip
    """Write a rank's note as a job event, behind the attempt fence; the same note twice in
    one attempt (a resend) is one event.

    Raises:
        StaleAttemptError / NotFoundError: the attempt is fenced off (nothing written).
    """
    job = check_attempt(session, job_id, attempt)
    text = note_text(kind, step, total_steps)
    seen = session.scalar(
        select(JobEvent.id)
        .where(JobEvent.job_id == job_id, JobEvent.attempt == attempt, JobEvent.reason == text)
        .limit(1)
    )
    if seen is None:
        _event(session, job, attempt, text)
