"""Workspace file upload use cases: begin an upload, tell where it stands, take each chunk
(``open_file_chunk`` gives the checkpoint uploads' ``ChunkReceiver``, the caller streams the
request body into it, ``finish_file_chunk`` keeps it and counts it), commit; or keep a batch
of small whole files at once (``store_file_batch``). The bytes go
through the checkpoint store backends (``stores``); the rows say what is committed
(``crud``). Each function owns its transactions and returns plain values.

Everything is the owner's: another owner's upload is "not found" (404), and an owner who
already has a file with this sha256 gets its committed upload back at once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from service.core.errors import ConflictError
from service.core.owners.quotas import QuotaLimits
from service.core.wire.batch import BATCH_FILE_MAX_BYTES
from service.core.wire.workspace import FileRef, check_limits
from service.store.checkpoints.backends.base import (
    CheckpointStore,
    CheckpointStoreError,
    CheckpointTooLargeError,
)
from service.store.checkpoints.checks import CheckpointInputError
from service.store.checkpoints.chunks import ChunkReceiver as ChunkReceiver  # for the routes
from service.store.checkpoints.chunks import UploadHashes as UploadHashes  # for the routes
from service.store.checkpoints.stores import CheckpointStores
from service.store.checkpoints.uploads import UploadStateError
from service.store.db import Database
from service.store.models import WorkspaceUpload
from service.store.quotas import check_workspace_room
from service.store.workspaces import batches, crud
from service.store.workspaces.stores import upload_key
from service.store.workspaces.values import BatchStored, FileUploadBegun, FileUploadState


class ChunkTooLargeError(CheckpointInputError):
    """A chunk whose declared length is over ``chunk_bytes`` (422, before any byte is read)."""


def _state(upload: WorkspaceUpload, chunk_bytes: int) -> FileUploadState:
    return FileUploadState(**crud.upload_fields(upload, chunk_bytes))


def _store(stores: CheckpointStores, name: str) -> CheckpointStore:
    store = stores.get(name)
    if store is None:
        raise CheckpointStoreError(f"workspace file store {name!r} is not available here")
    return store


def begin_file_upload(
    db: Database,
    stores: CheckpointStores,
    owner: str,
    *,
    sha256: str,
    size_bytes: int,
    store_name: str,
    chunk_bytes: int,
    max_bytes: int,
    limits: QuotaLimits | None = None,
) -> FileUploadBegun:
    """Begin the upload of one workspace file of ``size_bytes`` bytes into ``store_name``, or
    find the owner's upload of it begun before (resume it), or the committed one when the
    owner already has the file.

    ``limits``: the owner's quotas a new upload must fit.

    Raises:
        WorkspaceTooLargeError: the file alone is over ``max_bytes`` (413).
        CheckpointTooLargeError: the store caps files below ``size_bytes`` (413).
        QuotaExceededError: over the owner's workspace bytes (413) or uploads in flight
            (429 with Retry-After).
    """
    check_limits([(f"the file with sha256 {sha256}", size_bytes)], max_bytes, 1)
    store = _store(stores, store_name)
    cap = store.max_size_bytes()
    if cap is not None and size_bytes > cap:
        raise CheckpointTooLargeError(
            f"a workspace file of {size_bytes} bytes exceeds the {store.name} store's cap of "
            f"{cap} bytes (DDPQ_CHECKPOINT_DB_MAX_BYTES): raise it, or use "
            "DDPQ_CHECKPOINT_STORE=filesystem"
        )
    with db.session() as session:
        upload, created = crud.begin_upload(
            session, owner, sha256=sha256, size_bytes=size_bytes, store=store.name,
            limits=limits,
        )  # fmt: skip
        if not created and upload.state == crud.RECEIVING:
            held = _store(stores, upload.store).received_size(upload_key(upload.id))
            crud.reconcile_received(session, upload, held)
        state = _state(upload, chunk_bytes)
    if created:
        store.begin(upload_key(state.upload_id))
    return FileUploadBegun(state, created)


def read_file_upload(
    db: Database, stores: CheckpointStores, owner: str, upload_id: int, *, chunk_bytes: int
) -> FileUploadState:
    """Where the owner's upload ``upload_id`` stands, ``received_bytes`` lowered to what its
    store really holds.

    Raises:
        WorkspaceUploadNotFoundError: none, or another owner's (404).
    """
    with db.session() as session:
        upload = crud.get_upload(session, owner, upload_id)
        store = stores.get(upload.store)
        if store is not None and upload.state == crud.RECEIVING:
            crud.reconcile_received(session, upload, store.received_size(upload_key(upload.id)))
        return _state(upload, chunk_bytes)


def open_file_chunk(
    db: Database,
    stores: CheckpointStores,
    hashes: UploadHashes,
    owner: str,
    upload_id: int,
    *,
    offset: int,
    chunk_bytes: int,
) -> ChunkReceiver:
    """A receiver of the chunk at ``offset`` of the owner's upload, its writer open in the
    upload's store: stream the body into it, then ``finish_file_chunk`` (or ``abort`` it).

    Raises:
        WorkspaceUploadNotFoundError: none, or another owner's (404).
        UploadStateError: not receiving, or ``offset`` is not ``received_bytes`` (409).
        CheckpointStoreError: the store is not configured here, or holds fewer than
            ``offset`` bytes (503).
    """
    with db.session(write=False) as session:
        upload = crud.get_upload(session, owner, upload_id)
        crud.check_offset(upload, offset, chunk_bytes)
        store_name, size_bytes = upload.store, upload.size_bytes
    writer = _store(stores, store_name).open_chunk(upload_key(upload_id), offset)
    return ChunkReceiver(
        upload_id=upload_id, offset=offset, size_bytes=size_bytes, chunk_bytes=chunk_bytes,
        writer=writer, hashes=hashes,
    )  # fmt: skip


def finish_file_chunk(
    db: Database, owner: str, receiver: ChunkReceiver, chunk_sha256: str
) -> FileUploadState:
    """Keep the received chunk once it matches ``chunk_sha256`` (hex), then move the upload's
    ``received_bytes`` past it (one compare-and-set).

    Raises:
        CheckpointInputError: the chunk is empty or does not match (422; abort it).
        UploadStateError: the upload moved meanwhile (409, its status in ``detail``).
    """
    receiver.commit(chunk_sha256)
    with db.session() as session:
        moved = crud.advance_upload(
            session, owner, receiver.upload_id, offset=receiver.offset,
            length=receiver.received, chunk_bytes=receiver.chunk_bytes,
        )  # fmt: skip
        state = _state(moved, receiver.chunk_bytes)
    receiver.remember()
    return state


def _whole_sha256(store: CheckpointStore, hashes: UploadHashes, upload: WorkspaceUpload) -> str:
    """The upload's sha256 as ``store`` holds it: followed as the chunks arrived when this
    process took them all, else read back."""
    key = upload_key(upload.id)
    sha256 = hashes.whole(upload.id, upload.size_bytes)
    if sha256 is not None and store.received_size(key) == upload.size_bytes:
        return sha256
    try:
        return store.partial_sha256(key)
    except OSError as exc:
        raise CheckpointStoreError(f"cannot read upload {upload.id} back: {exc}") from None


def commit_file_upload(
    db: Database,
    stores: CheckpointStores,
    hashes: UploadHashes,
    owner: str,
    upload_id: int,
    *,
    chunk_bytes: int,
) -> FileUploadState:
    """Verify the whole file's size and sha256 as its store holds them, finalize it there and
    write the owner's file row (the upload ``committed``). A committed upload answers as it is.

    Raises:
        WorkspaceUploadNotFoundError: none, or another owner's (404).
        UploadStateError: bytes are missing, or the upload was abandoned (409, the status in
            ``detail``: resend from ``received_bytes``, or begin again).
        WorkspaceFileInputError: the sha256 does not match (422): the upload is abandoned
            and its bytes dropped; begin it again.
        CheckpointStoreError: the store cannot read or finalize the bytes (503).
    """
    with db.session() as session:
        upload = crud.get_upload(session, owner, upload_id)
        if upload.state == crud.COMMITTED:
            return _state(upload, chunk_bytes)
        store = _store(stores, upload.store)
        if upload.state == crud.RECEIVING:
            crud.reconcile_received(session, upload, store.received_size(upload_key(upload.id)))
        crud.check_offset(upload, upload.size_bytes, chunk_bytes)
        session.expunge(upload)
    sha256 = _whole_sha256(store, hashes, upload)
    key = upload_key(upload_id)
    if sha256 != upload.sha256:
        with db.session() as session:
            crud.set_state(session, crud.get_upload(session, owner, upload_id), crud.ABANDONED)
        store.discard(key)
        hashes.forget(upload_id)
        raise crud.WorkspaceFileInputError(
            f"upload {upload_id}: the file's sha256 is {sha256}, not {upload.sha256} (changed "
            "or corrupted on the way); the upload is discarded: begin it again"
        )
    location = store.finalize(key)
    with db.session() as session:
        row = crud.get_upload(session, owner, upload_id)
        held = crud.find_file(session, owner, row.sha256)
        if held is not None and held.upload_id != row.id:
            # Another upload of this content committed first: its bytes count, these are
            # dropped with the abandoned upload (the reaper).
            crud.set_state(session, row, crud.ABANDONED)
            row = session.get_one(WorkspaceUpload, held.upload_id)
        elif crud.set_state(session, row, crud.COMMITTED) or row.state == crud.COMMITTED:
            crud.record_file(session, row, location)
        else:
            raise UploadStateError(crud.upload_fields(row, chunk_bytes))
        state = _state(row, chunk_bytes)
    hashes.forget(upload_id)
    return state


def _batch_refusal(ref: FileRef, data: bytes, cap: int | None, max_bytes: int) -> str | None:
    """Why a file of a batch cannot be kept, or None when it can."""
    if ref.size_bytes > BATCH_FILE_MAX_BYTES:
        return (
            f"{ref.size_bytes} bytes is more than a batch carries per file "
            f"({BATCH_FILE_MAX_BYTES}): send it with the chunk protocol (POST /workspaces/files)"
        )
    if ref.size_bytes > min(max_bytes, cap if cap is not None else max_bytes):
        return f"{ref.size_bytes} bytes is more than this server stores per file"
    if hashlib.sha256(data).hexdigest() != ref.sha256:
        return (
            f"its {len(data)} bytes do not match its sha256 (a wrong size or sha256, or "
            "changed on the way): nothing kept, send it again"
        )
    return None


def store_file_batch(
    db: Database,
    stores: CheckpointStores,
    owner: str,
    files: Sequence[tuple[FileRef, bytes]],
    *,
    store_name: str,
    max_bytes: int,
    limits: QuotaLimits | None = None,
) -> BatchStored:
    """Keep the owner's whole small files ``files`` (``(ref, data)`` pairs, split from a
    batch body) that match their sha256, in ``store_name``: their upload rows reserved in one
    transaction, their bytes stored together (``CheckpointStore.put_files``), then every row
    committed in one more. A file the owner already has is acknowledged, not stored again; a
    file listed twice counts once.

    Args:
        max_bytes: the workspace bytes cap (``DDPQ_WORKSPACE_MAX_BYTES``), here per file.
        limits: the owner's workspace bytes quota the new files must fit, all together.

    Raises:
        QuotaExceededError: the new files do not fit the owner's quota (413, none kept).
        CheckpointStoreError: the store is not available here or could not write the bytes
            (503: nothing of the batch is kept; send it again).
        ConflictError: a concurrent commit got in between (409: send the batch again).
    """
    store = _store(stores, store_name)
    cap = store.max_size_bytes()
    good: dict[str, tuple[FileRef, bytes]] = {}
    refused: dict[str, str] = {}
    for ref, data in files:
        if ref.sha256 in good:
            continue
        reason = _batch_refusal(ref, data, cap, max_bytes)
        if reason is None:
            good[ref.sha256] = (ref, data)
            refused.pop(ref.sha256, None)
        else:
            refused.setdefault(ref.sha256, reason)
    with db.session() as session:
        present = crud.present_sha256s(session, owner, good)
        new = [pair for sha256, pair in good.items() if sha256 not in present]
        if limits is not None and new:
            check_workspace_room(session, owner, adding=sum(r.size_bytes for r, _ in new),
                                 limits=limits)  # fmt: skip
        ids = batches.reserve_uploads(session, owner, [r for r, _ in new], store.name)
    if new:
        keys = [upload_key(upload_id) for upload_id in ids]
        try:
            locations = store.put_files(
                [(key, data) for key, (_, data) in zip(keys, new, strict=True)]
            )
            kept = [(i, ref, loc) for i, (ref, _), loc in zip(ids, new, locations, strict=True)]
            try:
                with db.session() as session:
                    dropped = batches.commit_uploads(session, owner, store.name, kept)
            except ConflictError:  # another commit of one of these files won: it counts
                with db.session() as session:
                    dropped = batches.commit_uploads(session, owner, store.name, kept)
        except Exception:
            with db.session() as session:
                batches.abandon_uploads(session, ids)
            for key in keys:
                store.discard(key)
            raise
        for upload_id in dropped:
            store.discard(upload_key(upload_id))
    return BatchStored(list(good), list(refused.items()))
