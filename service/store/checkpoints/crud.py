"""Checkpoint rows: what rank 0 wrote, where (store + location), how big, and its sha256.

A row is written only for a complete, verified file (recorded by a rank sharing the API's
filesystem, or committed from an upload: ``checkpoint_uploads``); it is the only "latest"
pointer. Retention (``checkpoint_retention``) marks rows deleted."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.core.errors import NotFoundError
from service.core.events import EventKind
from service.store.events import record_event
from service.store.models import Checkpoint, utcnow
from service.store.workers.leases import check_attempt


def record_checkpoint(
    session: Session,
    job_id: int,
    attempt: int,
    *,
    step: int,
    epoch: int,
    path: str,
    size_bytes: int,
    sha256: str,
    store: str = "filesystem",
    location: str | None = None,
    file_name: str | None = None,
) -> Checkpoint:
    """Record a committed checkpoint of the current attempt; a re-record of the same step
    replaces it. ``location`` (default: ``path``) is where ``store`` keeps the bytes;
    ``file_name`` the workspace file a followed checkpoint is a version of (None: ddpq's own).

    Raises:
        StaleAttemptError / NotFoundError: the attempt is fenced off (see ``check_attempt``).
    """
    check_attempt(session, job_id, attempt)
    ckpt = session.scalars(
        select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step)
    ).one_or_none()
    if ckpt is None:
        ckpt = Checkpoint(job_id=job_id, step=step)
        session.add(ckpt)
    now = utcnow()
    ckpt.attempt, ckpt.epoch, ckpt.path = attempt, epoch, path
    ckpt.size_bytes, ckpt.sha256, ckpt.created_at, ckpt.deleted_at = size_bytes, sha256, now, None
    ckpt.store, ckpt.location, ckpt.committed_at = (
        store,
        path if location is None else location,
        now,
    )
    ckpt.resumed_by_attempt, ckpt.file_name = None, file_name
    session.flush()
    return ckpt


def record_checkpoint_failure(
    session: Session, job_id: int, attempt: int, *, step: int, reason: str
) -> None:
    """Note a checkpoint that could not be written as a job event (the state does not change:
    from_state = to_state), so ``ddpq show`` and the API's events list show it.

    Raises:
        StaleAttemptError / NotFoundError: the attempt is fenced off (see ``check_attempt``).
    """
    job = check_attempt(session, job_id, attempt)
    record_event(
        session, job_id, attempt, EventKind.CHECKPOINT_FAILED, {"step": step, "reason": reason},
        from_state=job.state, to_state=job.state,
    )  # fmt: skip


def list_checkpoints(session: Session, job_id: int) -> list[Checkpoint]:
    """A job's live (not deleted) checkpoints, newest step first."""
    return list(
        session.scalars(
            select(Checkpoint)
            .where(Checkpoint.job_id == job_id, Checkpoint.deleted_at.is_(None))
            .order_by(Checkpoint.step.desc())
        )
    )


def get_checkpoint(session: Session, job_id: int, step: int) -> Checkpoint:
    """The live checkpoint of ``job_id`` at ``step``.

    Raises:
        NotFoundError: none recorded (or it was rotated away).
    """
    ckpt = session.scalars(
        select(Checkpoint).where(
            Checkpoint.job_id == job_id, Checkpoint.step == step, Checkpoint.deleted_at.is_(None)
        )
    ).one_or_none()
    if ckpt is None:
        raise NotFoundError(f"job {job_id} has no checkpoint at step {step}")
    return ckpt


def mark_checkpoints_deleted(
    session: Session, job_id: int, steps: list[int]
) -> list[tuple[int, str, str]]:
    """Mark the job's live checkpoints at ``steps`` deleted (rotated away or damaged, as a
    rank reports); ``(step, store, location)`` of each, for the caller to remove from its
    store after commit (a file the rank removed already is fine)."""
    if not steps:
        return []
    rows = list(
        session.scalars(
            select(Checkpoint).where(
                Checkpoint.job_id == job_id,
                Checkpoint.step.in_(steps),
                Checkpoint.deleted_at.is_(None),
            )
        )
    )
    now = utcnow()
    for ckpt in rows:
        ckpt.deleted_at = now
    return [(c.step, c.store, c.location) for c in rows]


def mark_resumed(session: Session, job_id: int, attempt: int, step: int) -> Checkpoint:
    """Note that ``attempt`` resumes from the job's live checkpoint at ``step`` (the caller
    has fenced the attempt): retention keeps it until that attempt commits a newer one
    (``checkpoint_retention``). Returns the checkpoint.

    Raises:
        NotFoundError: no live checkpoint at ``step``.
    """
    ckpt = get_checkpoint(session, job_id, step)
    ckpt.resumed_by_attempt = attempt
    return ckpt
