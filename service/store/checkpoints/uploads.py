"""Checkpoint uploads: the rows that track a checkpoint file crossing from rank 0 to a store.

An upload is ``receiving`` while chunks arrive (``received_bytes`` is where the next one goes,
advanced by one compare-and-set per chunk), then ``committed`` in the same transaction that
writes its ``checkpoints`` row and applies retention, or ``abandoned`` (a newer checkpoint
began, its sha256 did not match, its attempt was superseded, it went stale). Every write is
fenced on the attempt (``leases.check_attempt``): a superseded attempt changes nothing.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, Text, exists, or_, select, update
from sqlalchemy import cast as sql_cast
from sqlalchemy.orm import Session

from service.core.artifacts import relative_checkpoint_path
from service.core.errors import ConflictError, DdpqError
from service.core.owners.quotas import QuotaLimits
from service.core.states import ACTIVE_STATES
from service.store.checkpoints.backends.base import UploadKey
from service.store.checkpoints.crud import record_checkpoint_failure
from service.store.checkpoints.retention import record_and_retain
from service.store.checkpoints.values import DoomedFile, PendingDiscard
from service.store.models import Checkpoint, CheckpointUpload, Job, utcnow
from service.store.quotas import check_checkpoint_room
from service.store.workers.leases import check_attempt

RECEIVING, COMMITTED, ABANDONED = "receiving", "committed", "abandoned"


class UploadNotFoundError(DdpqError):
    """No such upload of this job (another job's upload is "not found" too). Not a
    ``NotFoundError``: that one means the job itself is gone (the attempt fence's answer)."""

    status_code = 404
    code = "not_found"


class UploadStateError(ConflictError):
    """The upload is not where the request assumed (another offset, already committed or
    abandoned); ``detail`` is the upload's status (``upload_status``), to resume from."""

    code = "upload_state"


def upload_key(upload: CheckpointUpload) -> UploadKey:
    """The store's key of ``upload``."""
    return UploadKey(upload_id=upload.id, job_id=upload.job_id, step=upload.step)


def upload_status(upload: CheckpointUpload, chunk_bytes: int) -> dict[str, Any]:
    """The upload as the wire's ``UploadStatus`` fields."""
    return {
        "upload_id": upload.id,
        "step": upload.step,
        "size_bytes": upload.size_bytes,
        "received_bytes": upload.received_bytes,
        "chunk_bytes": chunk_bytes,
        "state": upload.state,
    }


def begin_upload(
    session: Session,
    job_id: int,
    attempt: int,
    *,
    step: int,
    epoch: int,
    size_bytes: int,
    sha256: str,
    store: str,
    file_name: str | None = None,
    limits: QuotaLimits | None = None,
) -> tuple[CheckpointUpload, bool, list[PendingDiscard]]:
    """Begin (or find again) the upload of one checkpoint file of the current attempt
    (``file_name``: the workspace file a followed checkpoint is a version of, kept for the
    commit).

    The same ``(attempt, step, sha256, file_name)`` begun before and not abandoned is
    returned as it is (an interrupted upload resumes at its ``received_bytes``). Otherwise a
    new upload starts, and the job's other receiving uploads of an older step (or of the same
    step with other bytes, or of an earlier attempt) are abandoned: only the newest
    checkpoint needs to go.

    With ``limits``, a new upload is begun only when its ``size_bytes`` fit the job's and
    its owner's checkpoint quotas and the owner's uploads in flight
    (``quotas.check_checkpoint_room``); a resumed one was counted when it began.

    Returns:
        ``(upload, created, discards)``: drop the ``discards``' bytes after commit.
    Raises:
        StaleAttemptError / NotFoundError: the attempt is fenced off.
        QuotaExceededError: over a quota (nothing written; roll back).
    """
    job = check_attempt(session, job_id, attempt)
    existing = session.scalars(
        select(CheckpointUpload)
        .where(
            CheckpointUpload.job_id == job_id,
            CheckpointUpload.attempt == attempt,
            CheckpointUpload.step == step,
            CheckpointUpload.sha256 == sha256,
            CheckpointUpload.file_name.is_not_distinct_from(file_name),
            CheckpointUpload.state != ABANDONED,
        )
        .order_by(CheckpointUpload.id.desc())
        .limit(1)
    ).one_or_none()
    if existing is not None:
        return existing, False, []
    superseded = list(
        session.scalars(
            select(CheckpointUpload).where(
                CheckpointUpload.job_id == job_id,
                CheckpointUpload.state == RECEIVING,
                or_(CheckpointUpload.step <= step, CheckpointUpload.attempt != attempt),
            )
        )
    )
    now = utcnow()
    for old in superseded:
        old.state, old.updated_at = ABANDONED, now
    if limits is not None:
        session.flush()
        check_checkpoint_room(
            session, job_id, job.owner, adding=size_bytes, limits=limits,
            freed=sum(old.received_bytes for old in superseded),
        )  # fmt: skip
    upload = CheckpointUpload(
        job_id=job_id,
        attempt=attempt,
        step=step,
        epoch=epoch,
        size_bytes=size_bytes,
        sha256=sha256,
        received_bytes=0,
        state=RECEIVING,
        store=store,
        created_at=now,
        updated_at=now,
        file_name=file_name,
    )
    session.add(upload)
    session.flush()
    return upload, True, [PendingDiscard(u.store, upload_key(u)) for u in superseded]


def get_upload(session: Session, job_id: int, upload_id: int) -> CheckpointUpload:
    """Upload ``upload_id`` of job ``job_id``.

    Raises:
        UploadNotFoundError: no such upload of this job (another job's is "not found" too).
    """
    upload = session.get(CheckpointUpload, upload_id)
    if upload is None or upload.job_id != job_id:
        raise UploadNotFoundError(f"upload {upload_id} not found")
    return upload


def reconcile_received(session: Session, upload: CheckpointUpload, held_bytes: int) -> None:
    """Lower ``received_bytes`` to what the store really holds (after a crash of the API the
    row may count bytes its store lost); never raises it."""
    if upload.state == RECEIVING and held_bytes < upload.received_bytes:
        session.execute(
            update(CheckpointUpload)
            .where(
                CheckpointUpload.id == upload.id,
                CheckpointUpload.received_bytes == upload.received_bytes,
            )
            .values(received_bytes=held_bytes)
        )
        upload.received_bytes = held_bytes


def check_chunk_offset(
    upload: CheckpointUpload, attempt: int, offset: int, chunk_bytes: int
) -> None:
    """Raise unless ``attempt`` may write a chunk at ``offset`` now (only the attempt that
    began an upload writes or commits it).

    Raises:
        UploadStateError: begun by another attempt, not receiving, or ``offset`` is not
            ``received_bytes`` (409).
    """
    if upload.attempt != attempt or upload.state != RECEIVING or offset != upload.received_bytes:
        raise UploadStateError(upload_status(upload, chunk_bytes))


def advance_upload(
    session: Session,
    job_id: int,
    attempt: int,
    upload_id: int,
    *,
    offset: int,
    length: int,
    chunk_bytes: int,
) -> CheckpointUpload:
    """Count a stored chunk: ``received_bytes`` from ``offset`` to ``offset + length``, one
    compare-and-set (a concurrent chunk at the same offset loses). ``chunk_bytes``: the
    server's chunk size, told in the loser's status.

    Raises:
        StaleAttemptError / NotFoundError: the attempt is fenced off.
        UploadNotFoundError: no such upload of this job.
        UploadStateError: the upload moved meanwhile (its status in ``detail``).
    """
    check_attempt(session, job_id, attempt)
    result = session.execute(
        update(CheckpointUpload)
        .where(
            CheckpointUpload.id == upload_id,
            CheckpointUpload.job_id == job_id,
            CheckpointUpload.attempt == attempt,
            CheckpointUpload.state == RECEIVING,
            CheckpointUpload.received_bytes == offset,
        )
        .values(received_bytes=offset + length, updated_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    upload = get_upload(session, job_id, upload_id)
    session.refresh(upload)
    if cast(CursorResult[Any], result).rowcount != 1:
        raise UploadStateError(upload_status(upload, chunk_bytes))
    return upload


def abandon_upload(
    session: Session, job_id: int, attempt: int, upload_id: int, *, reason: str
) -> CheckpointUpload:
    """Abandon a receiving upload of the current attempt and note why as a job event
    ("checkpoint at step N not written: …").

    Raises:
        StaleAttemptError / NotFoundError: the attempt is fenced off.
        UploadNotFoundError: no such upload of this job.
    """
    check_attempt(session, job_id, attempt)
    upload = get_upload(session, job_id, upload_id)
    if upload.state == RECEIVING:
        upload.state, upload.updated_at = ABANDONED, utcnow()
    record_checkpoint_failure(session, job_id, attempt, step=upload.step, reason=reason)
    return upload


def commit_upload(
    session: Session, job_id: int, attempt: int, upload_id: int, *, location: str
) -> tuple[Checkpoint, list[DoomedFile]]:
    """Mark a complete, verified upload committed and write its checkpoints row (``store`` of
    the upload, ``location`` from the store's ``finalize``) in this one transaction, then
    apply retention (``retention.record_and_retain``).

    Returns:
        The row and the files retention let go (remove them after commit), the bytes of a
        replaced row of the same step included.
    Raises:
        StaleAttemptError / NotFoundError: the attempt is fenced off.
        UploadNotFoundError: no such upload of this job.
        UploadStateError: not receiving, begun by another attempt, or bytes missing.
    """
    check_attempt(session, job_id, attempt)
    upload = get_upload(session, job_id, upload_id)
    check_chunk_offset(upload, attempt, upload.size_bytes, 0)
    # A compare-and-set: the reaper abandons only receiving uploads the same way, so an
    # upload is committed or abandoned (its bytes discarded), never both.
    moved = session.execute(
        update(CheckpointUpload)
        .where(CheckpointUpload.id == upload.id, CheckpointUpload.state == RECEIVING)
        .values(state=COMMITTED, updated_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    if cast(CursorResult[Any], moved).rowcount != 1:
        session.refresh(upload)
        raise UploadStateError(upload_status(upload, 0))
    session.refresh(upload)
    # The file's name under an artifact root: where the filesystem store keeps it (a rank
    # sharing that directory finds it there), else the name a rank gives its own copy.
    root_relative = (
        location if upload.store == "filesystem" else relative_checkpoint_path(job_id, upload.step)
    )
    return record_and_retain(
        session,
        job_id,
        attempt,
        step=upload.step,
        epoch=upload.epoch,
        path=root_relative,
        size_bytes=upload.size_bytes,
        sha256=upload.sha256,
        store=upload.store,
        location=location,
        file_name=upload.file_name,
    )


def orphaned_uploads(session: Session, *, stale_s: float, limit: int = 100) -> list[PendingDiscard]:
    """Abandon receiving uploads that nobody will finish: of an attempt that is no longer
    its job's current, active one, or without a chunk for ``stale_s`` seconds; and take the
    abandoned ones' rows away, and those of committed database-store uploads that no live
    checkpoint names (with their chunk rows). Returns the partials whose bytes to drop
    (after commit)."""
    cutoff = utcnow() - timedelta(seconds=stale_s)
    active = [s.value for s in ACTIVE_STATES]
    stale = list(
        session.scalars(
            select(CheckpointUpload)
            .join(Job, Job.id == CheckpointUpload.job_id)
            .where(
                CheckpointUpload.state == RECEIVING,
                or_(
                    CheckpointUpload.updated_at < cutoff,
                    Job.attempt != CheckpointUpload.attempt,
                    Job.state.not_in(active),
                ),
            )
            .limit(limit)
        )
    )
    now = utcnow()
    for upload in stale:
        # Compare-and-set: a commit that won meanwhile keeps its upload (and its bytes).
        session.execute(
            update(CheckpointUpload)
            .where(CheckpointUpload.id == upload.id, CheckpointUpload.state == RECEIVING)
            .values(state=ABANDONED, updated_at=now)
            .execution_options(synchronize_session=False)
        )
    session.flush()
    session.expire_all()
    abandoned = list(
        session.scalars(
            select(CheckpointUpload).where(CheckpointUpload.state == ABANDONED).limit(limit)
        )
    )
    # Committed uploads of the database store whose bytes no live row names any more (the
    # API stopped between retention's commit and the deletion of the chunk rows).
    named = exists().where(
        Checkpoint.job_id == CheckpointUpload.job_id,
        Checkpoint.step == CheckpointUpload.step,
        Checkpoint.deleted_at.is_(None),
        Checkpoint.store == CheckpointUpload.store,
        Checkpoint.location == sql_cast(CheckpointUpload.id, Text),
    )
    leaked = list(
        session.scalars(
            select(CheckpointUpload)
            .where(
                CheckpointUpload.state == COMMITTED,
                CheckpointUpload.store == "database",
                ~named,
            )
            .limit(limit)
        )
    )
    for upload in abandoned + leaked:
        session.delete(upload)  # its chunk rows go with it (ON DELETE CASCADE)
    session.flush()
    return [PendingDiscard(u.store, upload_key(u)) for u in abandoned + leaked]
