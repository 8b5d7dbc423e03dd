"""Checkpoint retention, owned by the database: which committed checkpoints of a job to keep.

Run in the transaction that commits (or records) a checkpoint, after its row is written:

- the newest ``training.keep_checkpoints`` live checkpoints are kept; since the new row is
  among them, an older checkpoint is never deleted before a newer one is committed;
- the checkpoint the current attempt resumed from is kept until that attempt has committed
  one with a greater step: the one it downloaded (``checkpoints.resumed_by_attempt``, set by
  the resume download), and the newest one of an earlier attempt (what a rank sharing the
  API's filesystem resumes from without downloading);
- a checkpoint named by the ``init_from`` of a job not yet terminal is kept (pinned).

Each deleted one is marked (``deleted_at``) with a job event; its bytes are removed from its
store once the transaction committed (``stores.delete_files``, called by the use cases of
``service.store.checkpoints.service``), so a rolled-back commit never leaves a live row
without its file. ``record_and_retain`` is the one sequence that writes a checkpoint row:
the file it replaces, the row, retention.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.core.events import EventKind
from service.core.states import TERMINAL_STATES
from service.store.checkpoints.crud import list_checkpoints, record_checkpoint
from service.store.checkpoints.values import DoomedFile
from service.store.events import record_event
from service.store.models import Checkpoint, Job, utcnow
from service.store.workers.leases import check_attempt

DEFAULT_KEEP = 3  # training.keep_checkpoints's default


def pinned_steps(session: Session, job_id: int) -> set[int]:
    """Steps of ``job_id`` that jobs not yet terminal start from (their ``init_from``)."""
    terminal = [s.value for s in TERMINAL_STATES]
    rows = session.scalars(
        select(Job.init_from_step).where(
            Job.init_from_job_id == job_id,
            Job.init_from_step.is_not(None),
            Job.state.not_in(terminal),
        )
    )
    return {int(s) for s in rows if s is not None}


def resume_protected_steps(job: Job, live: list[Checkpoint]) -> set[int]:
    """Steps the current attempt resumed from (or would have), until it committed a newer
    one. ``live`` is the job's live checkpoints."""
    candidates = {c.step for c in live if c.resumed_by_attempt == job.attempt}
    earlier = [c.step for c in live if c.attempt < job.attempt]
    if earlier:
        candidates.add(max(earlier))
    own = [c.step for c in live if c.attempt == job.attempt]
    newest_own = max(own, default=-1)
    return {s for s in candidates if newest_own <= s}


def keep_count(job: Job) -> int:
    """``training.keep_checkpoints`` of the job's spec (its default when absent)."""
    training = (job.spec or {}).get("training") or {}
    keep = training.get("keep_checkpoints", DEFAULT_KEEP)
    return keep if isinstance(keep, int) and keep >= 1 else DEFAULT_KEEP


def replaced_files(
    session: Session, job_id: int, step: int, *, store: str, location: str
) -> list[DoomedFile]:
    """The bytes of the live checkpoint at ``step`` that a new row at ``(store, location)``
    is about to replace (none when it is the same file): remove them after commit."""
    old = session.scalars(
        select(Checkpoint).where(
            Checkpoint.job_id == job_id, Checkpoint.step == step, Checkpoint.deleted_at.is_(None)
        )
    ).one_or_none()
    if old is None or (old.store, old.location) == (store, location):
        return []
    return [DoomedFile(job_id, step, old.store, old.location)]


def apply_retention(session: Session, job_id: int) -> list[DoomedFile]:
    """Mark deleted the live checkpoints of ``job_id`` that retention lets go (see the module
    docstring), with one event each; what to remove from the stores after commit.

    Call it with the job's row locked (``leases.check_attempt``), after the new checkpoint's
    row is flushed.
    """
    job = session.get(Job, job_id)
    if job is None:
        return []
    live = list_checkpoints(session, job_id)  # newest step first
    keep = keep_count(job)
    protected = pinned_steps(session, job_id) | resume_protected_steps(job, live)
    doomed: list[DoomedFile] = []
    now = utcnow()
    for ckpt in live[keep:]:
        if ckpt.step in protected:
            continue
        ckpt.deleted_at = now
        record_event(
            session, job_id, job.attempt, EventKind.CHECKPOINT_DELETED,
            {"step": ckpt.step, "keep": keep}, from_state=job.state, to_state=job.state,
        )  # fmt: skip
        doomed.append(DoomedFile(job_id, ckpt.step, ckpt.store, ckpt.location))
    session.flush()
    return doomed


def record_and_retain(
    session: Session,
    job_id: int,
    attempt: int,
    *,
    step: int,
    epoch: int,
    path: str,
    size_bytes: int,
    sha256: str,
    store: str,
    location: str,
    file_name: str | None = None,
) -> tuple[Checkpoint, list[DoomedFile]]:
    """Write the checkpoint row of a complete, verified file (``crud.record_checkpoint``:
    fenced, a re-record of ``step`` replaces it), then apply retention: the one sequence
    behind a shared-filesystem record and an upload's commit.

    Returns:
        The row and every file let go: the bytes of the row it replaced at ``step`` (when
        another file) and those retention deleted. Remove them after commit.
    Raises:
        StaleAttemptError / NotFoundError: the attempt is fenced off (nothing written).
    """
    check_attempt(session, job_id, attempt)  # row-locked first: a concurrent record waits
    doomed = replaced_files(session, job_id, step, store=store, location=location)
    ckpt = record_checkpoint(
        session,
        job_id,
        attempt,
        step=step,
        epoch=epoch,
        path=path,
        size_bytes=size_bytes,
        sha256=sha256,
        store=store,
        location=location,
        file_name=file_name,
    )
    return ckpt, doomed + apply_retention(session, job_id)
