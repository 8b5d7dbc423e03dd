"""Quotas: what one job or one owner may store or send, measured from the rows that say
where the bytes are, checked where the bytes arrive (``Settings``' ``*_max_bytes``,
``metric_*`` and ``uploads_in_flight_per_owner``).

Bytes are counted from the database, never from a directory walk, so every API process
agrees and the count includes what is not finished: an upload under way counts its declared
``size_bytes`` from its start (its room is reserved before a byte arrives, and a chunk never
carries it past that size), an abandoned one counts the bytes it received until the reaper
takes its row away (after it dropped them). So the bytes an API host keeps for jobs and
owners stay under the sum of the quotas whatever a rank or a user sends.

A check runs inside the transaction that then writes (a begin, a batch), serialised per
owner on PostgreSQL (a transaction-scoped advisory lock) and by SQLite's write lock, so two
concurrent uploads of one owner cannot both take the last room.

A refusal raises ``QuotaExceededError`` (its ``hit`` names the quota, the limit, the amount
asked and the setting to raise); the caller's transaction rolls back, and the caller writes
the job's ``quota_exceeded`` event in a new one (``record_quota_hit``).
"""

from __future__ import annotations

import hashlib

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from service.core.events import EventKind
from service.core.owners.quotas import QuotaExceededError, QuotaHit, QuotaLimits
from service.store.events import events_of_kinds, record_event
from service.store.models import Checkpoint, CheckpointUpload, Job, WorkspaceUpload

RECEIVING, ABANDONED = "receiving", "abandoned"
# Seconds an owner over DDPQ_UPLOADS_IN_FLIGHT_PER_OWNER is told to wait: an upload under way
# finishes, or goes stale and is reaped, in about that time or more.
UPLOADS_RETRY_AFTER_S = 10


def lock_owner(session: Session, owner: str) -> None:
    """Serialise quota checks of ``owner`` until the transaction ends (PostgreSQL: an
    advisory lock; SQLite's write transaction is serial already)."""
    if session.get_bind().dialect.name == "postgresql":
        digest = hashlib.sha256(b"ddpq-quota:" + owner.encode("utf-8")).digest()
        key = int.from_bytes(digest[:8], "big", signed=True)
        session.execute(select(func.pg_advisory_xact_lock(key)))


def _upload_bytes(model: type[CheckpointUpload] | type[WorkspaceUpload]) -> object:
    """Bytes an upload row holds or reserves: its size while receiving, what it received
    once abandoned (until reaped); 0 once committed (its file row counts it)."""
    return case(
        (model.state == RECEIVING, model.size_bytes),
        (model.state == ABANDONED, model.received_bytes),
        else_=0,
    )


def checkpoint_bytes(session: Session, *, job_id: int | None = None,
                     owner: str | None = None) -> int:  # fmt: skip
    """Checkpoint bytes of one job (``job_id``) or of all of ``owner``'s jobs: live
    checkpoints plus uploads under way (their declared size) and abandoned ones not yet
    reaped (what they received)."""
    live = select(func.coalesce(func.sum(Checkpoint.size_bytes), 0)).where(
        Checkpoint.deleted_at.is_(None)
    )
    pending = select(func.coalesce(func.sum(_upload_bytes(CheckpointUpload)), 0)).where(
        CheckpointUpload.state.in_((RECEIVING, ABANDONED))
    )
    if job_id is not None:
        live = live.where(Checkpoint.job_id == job_id)
        pending = pending.where(CheckpointUpload.job_id == job_id)
    else:
        live = live.join(Job, Job.id == Checkpoint.job_id).where(Job.owner == owner)
        pending = pending.join(Job, Job.id == CheckpointUpload.job_id).where(Job.owner == owner)
    return int(session.scalar(live) or 0) + int(session.scalar(pending) or 0)


def workspace_bytes(session: Session, owner: str) -> int:
    """Workspace file bytes of ``owner``: committed files (their upload row stays while the
    file lives), uploads under way (declared size) and abandoned ones not yet reaped."""
    committed = case((WorkspaceUpload.state == "committed", WorkspaceUpload.size_bytes), else_=0)
    total = session.scalar(
        select(func.coalesce(func.sum(committed + _upload_bytes(WorkspaceUpload)), 0)).where(
            WorkspaceUpload.owner == owner
        )
    )
    return int(total or 0)


def uploads_in_flight(session: Session, owner: str) -> int:
    """Checkpoint and workspace file uploads of ``owner`` begun and not finished."""
    checkpoints = session.scalar(
        select(func.count())
        .select_from(CheckpointUpload)
        .join(Job, Job.id == CheckpointUpload.job_id)
        .where(Job.owner == owner, CheckpointUpload.state == RECEIVING)
    )
    files = session.scalar(
        select(func.count())
        .select_from(WorkspaceUpload)
        .where(WorkspaceUpload.owner == owner, WorkspaceUpload.state == RECEIVING)
    )
    return int(checkpoints or 0) + int(files or 0)


def check_bytes(quota: str, setting: str, *, used: int, adding: int, limit: int) -> None:
    """Raise unless ``used + adding`` bytes fit ``limit``.

    Raises:
        QuotaExceededError: they do not (413).
    """
    if used + adding > limit:
        raise QuotaExceededError(
            QuotaHit(quota, limit, used + adding, setting, "bytes"), status_code=413
        )


def check_uploads_in_flight(session: Session, owner: str, *, limit: int) -> None:
    """Raise unless ``owner`` may begin one more upload.

    Raises:
        QuotaExceededError: ``limit`` uploads are under way already (429, Retry-After).
    """
    busy = uploads_in_flight(session, owner)
    if busy + 1 > limit:
        hit = QuotaHit("uploads in flight per owner", limit, busy + 1,
                       "DDPQ_UPLOADS_IN_FLIGHT_PER_OWNER", "uploads")  # fmt: skip
        raise QuotaExceededError(hit, status_code=429, retry_after_s=UPLOADS_RETRY_AFTER_S)


def record_quota_hit(session: Session, job_id: int, attempt: int, hit: QuotaHit) -> bool:
    """Write the job's ``quota_exceeded`` event for ``hit``, once per attempt and quota (a
    rank that keeps hitting it does not flood the job's events). The caller has locked the
    job's row (``leases.check_attempt``). True when written."""
    job = session.get(Job, job_id)
    if job is None:
        return False
    seen = events_of_kinds(session, job_id, attempt, (EventKind.QUOTA_EXCEEDED,))
    if any((e.data or {}).get("quota") == hit.quota for e in seen):
        return False
    record_event(session, job_id, attempt, EventKind.QUOTA_EXCEEDED, hit.event_data(),
                 from_state=job.state, to_state=job.state)  # fmt: skip
    return True


def check_checkpoint_room(
    session: Session,
    job_id: int,
    owner: str,
    *,
    adding: int,
    freed: int,
    limits: QuotaLimits,
    begins_upload: bool = True,
) -> None:
    """Raise unless ``adding`` more checkpoint bytes fit the job's and its owner's quotas,
    and (``begins_upload``) the owner may begin one more upload. ``freed``: bytes counted now
    that the caller's transaction lets go (partial uploads it abandoned, a checkpoint it
    replaces at the same step).
    Nothing is deleted to make room: only retention deletes checkpoints.

    Raises:
        QuotaExceededError: 413 for bytes, 429 (Retry-After) for uploads in flight.
    """
    lock_owner(session, owner)
    check_bytes("checkpoint bytes per job", "DDPQ_CHECKPOINT_JOB_MAX_BYTES",
                used=checkpoint_bytes(session, job_id=job_id) - freed, adding=adding,
                limit=limits.checkpoint_job_max_bytes)  # fmt: skip
    check_bytes("checkpoint bytes per owner", "DDPQ_CHECKPOINT_OWNER_MAX_BYTES",
                used=checkpoint_bytes(session, owner=owner) - freed, adding=adding,
                limit=limits.checkpoint_owner_max_bytes)  # fmt: skip
    if begins_upload:
        check_uploads_in_flight(session, owner, limit=limits.uploads_in_flight_per_owner)


def check_workspace_room(session: Session, owner: str, *, adding: int, limits: QuotaLimits) -> None:
    """Raise unless ``adding`` more workspace file bytes fit ``owner``'s quota (serialised
    per owner until the transaction ends).

    Raises:
        QuotaExceededError: they do not (413).
    """
    lock_owner(session, owner)
    check_bytes("workspace bytes per owner", "DDPQ_WORKSPACE_OWNER_MAX_BYTES",
                used=workspace_bytes(session, owner), adding=adding,
                limit=limits.workspace_owner_max_bytes)  # fmt: skip
