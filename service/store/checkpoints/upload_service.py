"""Checkpoint upload use cases that move bytes in: begin an upload, tell where it stands,
and each chunk (``open_chunk`` gives a ``chunks.ChunkReceiver`` the caller streams the
request body into, ``finish_chunk`` keeps it and counts it in the upload's row). Each
function owns its transaction and returns plain values; bytes go to the store as they
arrive, the rows say what is committed (``uploads``). The commit, which writes the
checkpoint's row, is ``service.commit_upload``.
"""

from __future__ import annotations

from service.core.owners.quotas import QuotaExceededError, QuotaLimits
from service.store.attempts.fence import superseded_on_fence
from service.store.attempts.tokens import current_state
from service.store.attempts.values import AttemptRef
from service.store.checkpoints import uploads
from service.store.checkpoints.backends.base import CheckpointStoreError, CheckpointTooLargeError
from service.store.checkpoints.chunks import ChunkReceiver as ChunkReceiver  # for the routes
from service.store.checkpoints.chunks import UploadHashes as UploadHashes  # for the routes
from service.store.checkpoints.crud import record_checkpoint_failure
from service.store.checkpoints.stores import CheckpointStores, discard_partials
from service.store.checkpoints.values import UploadBegun, UploadStatus
from service.store.db import Database
from service.store.models import CheckpointUpload
from service.store.quotas import record_quota_hit
from service.store.workers.leases import check_attempt


def _status(upload: CheckpointUpload, chunk_bytes: int) -> UploadStatus:
    return UploadStatus(**uploads.upload_status(upload, chunk_bytes))


def begin_upload(
    db: Database,
    stores: CheckpointStores,
    ref: AttemptRef,
    *,
    step: int,
    epoch: int,
    size_bytes: int,
    sha256: str,
    store_name: str,
    chunk_bytes: int,
    file_name: str | None = None,
    limits: QuotaLimits | None = None,
) -> UploadBegun:
    """Begin the upload of a checkpoint file into store ``store_name``, or find the one this
    attempt began for ``(step, sha256, file_name)`` (resume it). Older pending uploads of the
    job are abandoned and their bytes dropped. ``file_name``: the workspace file a followed
    checkpoint is a version of (its row gets it at the commit); None for ddpq's own.
    ``limits``: the quotas a new upload must fit (``quotas.check_checkpoint_room``).

    Raises:
        CheckpointTooLargeError: the store caps files below ``size_bytes`` (413).
        QuotaExceededError: over the job's or owner's checkpoint bytes (413: a failed save,
            with a ``checkpoint_failed`` and a ``quota_exceeded`` event), or the owner's
            uploads in flight (429 with Retry-After, a ``quota_exceeded`` event).
        StaleAttemptError: the attempt is superseded (409).
    """
    store = stores[store_name]
    cap = store.max_size_bytes()
    if cap is not None and size_bytes > cap:
        raise CheckpointTooLargeError(
            f"checkpoint of {size_bytes} bytes exceeds the {store.name} store's cap "
            f"of {cap} bytes (DDPQ_CHECKPOINT_DB_MAX_BYTES): raise it, or use "
            "DDPQ_CHECKPOINT_STORE=filesystem"
        )
    try:
        with superseded_on_fence(), db.session() as session:
            upload, created, discards = uploads.begin_upload(
                session, ref.job_id, ref.attempt, step=step, epoch=epoch,
                size_bytes=size_bytes, sha256=sha256, store=store.name, file_name=file_name,
                limits=limits,
            )  # fmt: skip
            key = uploads.upload_key(upload)
            if not created:
                held = stores[upload.store].received_size(key)
                uploads.reconcile_received(session, upload, held)
            status = _status(upload, chunk_bytes)
    except QuotaExceededError as exc:
        _note_refusal(db, ref, step, exc)
        raise
    discard_partials(stores, discards)
    if created:
        store.begin(key)
    return UploadBegun(status, created)


def _note_refusal(db: Database, ref: AttemptRef, step: int, exc: QuotaExceededError) -> None:
    """The job's events for a begin refused by a quota: a failed save (a bytes quota; a
    429 is retried by the rank, not a failure yet) and the quota's note."""
    with superseded_on_fence(), db.session() as session:
        check_attempt(session, ref.job_id, ref.attempt)  # row-locked: one note per attempt
        if exc.status_code != 429:
            record_checkpoint_failure(session, ref.job_id, ref.attempt, step=step,
                                      reason=exc.hit.words())  # fmt: skip
        record_quota_hit(session, ref.job_id, ref.attempt, exc.hit)


def read_upload_status(
    db: Database, stores: CheckpointStores, ref: AttemptRef, upload_id: int, *, chunk_bytes: int
) -> UploadStatus:
    """Where upload ``upload_id`` of the job stands, ``received_bytes`` lowered to what its
    store really holds (less than the row said if the API was killed meanwhile).

    Raises:
        StaleAttemptError: the attempt is superseded (409).
        UploadNotFoundError: no such upload of this job (404).
    """
    with db.session() as session:
        with superseded_on_fence():
            current_state(session, ref)
        upload = uploads.get_upload(session, ref.job_id, upload_id)
        store = stores.get(upload.store)
        if store is not None:
            held = store.received_size(uploads.upload_key(upload))
            uploads.reconcile_received(session, upload, held)
        return _status(upload, chunk_bytes)


def open_chunk(
    db: Database,
    stores: CheckpointStores,
    hashes: UploadHashes,
    ref: AttemptRef,
    upload_id: int,
    *,
    offset: int,
    chunk_bytes: int,
) -> ChunkReceiver:
    """A receiver of the chunk at ``offset`` of upload ``upload_id``, its writer open in the
    upload's store: stream the body into it, then ``finish_chunk`` (or ``abort`` it).

    Raises:
        StaleAttemptError: the attempt is superseded (409).
        UploadNotFoundError: no such upload of this job (404).
        UploadStateError: begun by another attempt, not receiving, or ``offset`` is not
            ``received_bytes`` (409, the status in ``detail``).
        CheckpointStoreError: the upload's store is not configured here, or holds fewer
            than ``offset`` bytes (503).
    """
    with db.session(write=False) as session:
        with superseded_on_fence():
            current_state(session, ref)
        upload = uploads.get_upload(session, ref.job_id, upload_id)
        uploads.check_chunk_offset(upload, ref.attempt, offset, chunk_bytes)
    store = stores.get(upload.store)
    if store is None:
        raise CheckpointStoreError(f"checkpoint store {upload.store!r} is not available here")
    writer = store.open_chunk(uploads.upload_key(upload), offset)
    return ChunkReceiver(
        upload_id=upload_id,
        offset=offset,
        size_bytes=upload.size_bytes,
        chunk_bytes=chunk_bytes,
        writer=writer,
        hashes=hashes,
    )


def finish_chunk(
    db: Database, ref: AttemptRef, receiver: ChunkReceiver, chunk_sha256: str
) -> UploadStatus:
    """Keep the received chunk once it matches ``chunk_sha256`` (hex), then move the upload's
    ``received_bytes`` past it (one fenced compare-and-set).

    Raises:
        CheckpointInputError: the chunk is empty or does not match (422; abort it).
        StaleAttemptError: the attempt is superseded (409).
        UploadStateError: the upload moved meanwhile (409, its status in ``detail``).
    """
    receiver.commit(chunk_sha256)
    with superseded_on_fence(), db.session() as session:
        moved = uploads.advance_upload(
            session, ref.job_id, ref.attempt, receiver.upload_id, offset=receiver.offset,
            length=receiver.received, chunk_bytes=receiver.chunk_bytes,
        )  # fmt: skip
        status = _status(moved, receiver.chunk_bytes)
    receiver.remember()
    return status
