"""The attempt API's checkpoint uploads: in chunks from rank 0 into the checkpoint store,
committed once verified (``service.core.wire.attempt`` describes the protocol; the ranks'
downloads are ``attempt_downloads``).

Who may call it: only a holder of an attempt token, for its own job, while its attempt is the
job's current, active one (else 409 ``attempt superseded``); a user or API token is 401
(``deps.get_attempt``). An upload id of another job is "not found" (404), as is a
checkpoint of another job: the token names the job, no route takes one.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Header, Path, Query, Request, Response
from starlette.requests import ClientDisconnect

from service.api.attempts.routes import ERRORS, AttemptInputError, _body_doc, _fenced, _json_body
from service.api.attempts.upload_hashes import upload_hashes
from service.api.deps import REQUIRE_ATTEMPT, AttemptDep
from service.api.files import (
    checkpoint_stores,
    upload_store,
)
from service.core.wire import attempt as wire
from service.store.attempts.tokens import current_state
from service.store.checkpoints.backends.base import (
    CheckpointStore,
    CheckpointStoreError,
    CheckpointTooLargeError,
    ChunkWriter,
)
from service.store.checkpoints.crud import get_checkpoint
from service.store.checkpoints.retention import delete_files
from service.store.checkpoints.uploads import (
    COMMITTED,
    abandon_upload,
    advance_upload,
    begin_upload,
    check_chunk_offset,
    commit_upload,
    get_upload,
    reconcile_received,
    upload_key,
    upload_status,
)
from service.store.db import Database
from service.store.models import Checkpoint, CheckpointUpload

router = APIRouter(tags=["attempts"], dependencies=[REQUIRE_ATTEMPT], responses=ERRORS)

# Bytes of a chunk body gathered before one hash-and-write in a thread (one hop each: at
# 1 MiB the hops cost a fifth of a 16 MiB chunk's time on a 2-core box).
WRITE_BLOCK_BYTES = 4 << 20
UploadIdPath = Annotated[int, Path(ge=1, le=2**63 - 1, description="The upload's id.")]
StepPath = Annotated[int, Path(ge=0, le=wire.MAX_STEP, description="Global step.")]


async def _in_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def _db(request: Request) -> Database:
    db: Database = request.app.state.db
    return db


def _chunk_bytes(request: Request) -> int:
    return int(request.app.state.settings.checkpoint_chunk_bytes)


def _status(upload: CheckpointUpload, chunk_bytes: int) -> wire.UploadStatus:
    return wire.UploadStatus(**upload_status(upload, chunk_bytes))


def _json(model: Any, status_code: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status_code, media_type="application/json")


def _upload_lock(app: FastAPI, upload_id: int) -> asyncio.Lock:
    """One chunk or commit of an upload at a time in this process (two PUTs of one offset
    would otherwise write the same bytes of a partial file at once)."""
    locks: dict[int, asyncio.Lock] | None = getattr(app.state, "upload_locks", None)
    if locks is None:
        locks = app.state.upload_locks = {}
    if len(locks) > 10_000:
        for key in [k for k, lock in locks.items() if not lock.locked()]:
            del locks[key]
    return locks.setdefault(upload_id, asyncio.Lock())


def _entry(ckpt: Checkpoint) -> wire.CheckpointEntry:
    return wire.CheckpointEntry(
        step=ckpt.step,
        epoch=ckpt.epoch,
        attempt=ckpt.attempt,
        path=ckpt.path,
        size_bytes=ckpt.size_bytes,
        sha256=ckpt.sha256,
    )


def _corrupt_if_asked(app: FastAPI, piece: bytes, first: bool) -> bytes:
    """The test hook ``checkpoint_corrupt_chunk_n``: flip the first byte of the Nth chunk
    this process receives, as a network fault would (its sha256 then fails)."""
    nth = app.state.settings.checkpoint_corrupt_chunk_n
    if nth is None or not first or not piece:
        return piece
    seen = getattr(app.state, "checkpoint_chunks_seen", 0) + 1
    app.state.checkpoint_chunks_seen = seen
    if seen != nth:
        return piece
    return bytes([piece[0] ^ 0xFF]) + piece[1:]


# -- uploads ----------------------------------------------------------------------------------


@router.post(
    wire.UPLOADS_PATH,
    status_code=201,
    response_model=wire.UploadStatus,
    summary="Begin (or resume) a checkpoint upload",
    responses={
        200: {"model": wire.UploadStatus, "description": "Begun before: resume from it"},
        413: {"description": "Bigger than the store accepts (DDPQ_CHECKPOINT_DB_MAX_BYTES)"},
    },
    openapi_extra=_body_doc(wire.UploadStart),
)
async def begin_upload_route(
    request: Request,
    ref: AttemptDep,
    start: Annotated[wire.UploadStart, _json_body(wire.UploadStart)],
) -> Response:
    """Begin the upload of a checkpoint file rank 0 wrote: 201 with its status, or 200 with
    the same upload when this attempt began ``(step, sha256)`` before (resume at
    ``received_bytes``). Older pending uploads of the job are abandoned.

    Caller: a rank holding the attempt token (nobody else); 409 ``attempt superseded`` when
    the attempt is not current; 413 when the store caps files below ``size_bytes``.
    """
    app: FastAPI = request.app
    store = upload_store(app)
    stores = checkpoint_stores(app)
    chunk_bytes = _chunk_bytes(request)

    def begin() -> tuple[wire.UploadStatus, bool]:
        cap = store.max_size_bytes()
        if cap is not None and start.size_bytes > cap:
            raise CheckpointTooLargeError(
                f"checkpoint of {start.size_bytes} bytes exceeds the {store.name} store's cap "
                f"of {cap} bytes (DDPQ_CHECKPOINT_DB_MAX_BYTES): raise it, or use "
                "DDPQ_CHECKPOINT_STORE=filesystem"
            )
        with _fenced(ref), _db(request).session() as session:
            upload, created, discards = begin_upload(
                session, ref.job_id, ref.attempt, **start.model_dump(), store=store.name
            )
            key = upload_key(upload)
            if not created:
                reconcile_received(session, upload, stores[upload.store].received_size(key))
            status = _status(upload, chunk_bytes)
        for d in discards:
            if d.store in stores:
                stores[d.store].discard(d.key)
        if created:
            store.begin(key)
        return status, created

    status, created = await _in_thread(begin)
    return _json(status, 201 if created else 200)


@router.get(wire.UPLOAD_PATH, response_model=wire.UploadStatus, summary="Where an upload stands")
def upload_status_route(request: Request, ref: AttemptDep, upload_id: UploadIdPath) -> Response:
    """The upload's status: resume at ``received_bytes`` (what the store really holds, which
    may be less than the last answer said if the API was killed meanwhile).

    Caller: a rank holding the attempt token, for its own job's uploads (another job's: 404);
    409 ``attempt superseded`` when the attempt is not current.
    """
    stores = checkpoint_stores(request.app)
    with _db(request).session() as session:
        with _fenced(ref):
            current_state(session, ref)
        upload = get_upload(session, ref.job_id, upload_id)
        store = stores.get(upload.store)
        if store is not None:
            reconcile_received(session, upload, store.received_size(upload_key(upload)))
        return _json(_status(upload, _chunk_bytes(request)))


@router.put(
    wire.UPLOAD_CHUNK_PATH,
    response_model=wire.UploadStatus,
    summary="Send one chunk of an upload",
    responses={
        409: {"description": "Not at this offset (detail: the UploadStatus), or superseded"},
        422: {"description": "The body does not match its sha256, or is too big: send again"},
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/octet-stream": {"schema": {"type": "string"}}},
        }
    },
)
async def upload_chunk_route(
    request: Request,
    ref: AttemptDep,
    upload_id: UploadIdPath,
    offset: Annotated[int, Query(ge=0, le=wire.MAX_SIZE_BYTES, description="Byte offset.")],
    chunk_sha256: Annotated[
        str,
        Header(
            alias=wire.CHUNK_SHA256_HEADER,
            pattern=r"^[0-9a-f]{64}$",
            description="sha256 (hex) of the body.",
        ),
    ],
) -> Response:
    """Store the body (raw bytes, streamed into the store, at most ``chunk_bytes``) at
    ``offset`` of the upload, once it matched its sha256; then ``received_bytes`` moves on.

    Caller: a rank holding the attempt token, for its own job's uploads (another job's: 404);
    409 ``attempt superseded`` when the attempt is not current; 409 with the UploadStatus
    when ``offset`` is not ``received_bytes``; 422 (nothing kept) for a body that is too big
    or does not match ``X-Ddpq-Chunk-Sha256``.
    """
    app: FastAPI = request.app
    chunk_bytes = _chunk_bytes(request)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > chunk_bytes:
        raise AttemptInputError(f"chunk of {declared} bytes exceeds chunk_bytes={chunk_bytes}")
    stores = checkpoint_stores(app)
    hashes = upload_hashes(app)

    def load() -> tuple[CheckpointUpload, CheckpointStore]:
        with _db(request).session(write=False) as session:
            with _fenced(ref):
                current_state(session, ref)
            upload = get_upload(session, ref.job_id, upload_id)
            check_chunk_offset(upload, ref.attempt, offset, chunk_bytes)
        store = stores.get(upload.store)
        if store is None:
            raise CheckpointStoreError(f"checkpoint store {upload.store!r} is not available here")
        return upload, store

    async with _upload_lock(app, upload_id):
        upload, store = await _in_thread(load)
        limit = min(chunk_bytes, upload.size_bytes - offset)
        writer: ChunkWriter = await _in_thread(store.open_chunk, upload_key(upload), offset)
        digest = hashlib.sha256()
        running = hashes.resume(upload_id, offset)  # the whole file's, so far

        def put(data: bytes) -> None:
            digest.update(data)
            if running is not None:
                running.update(data)
            writer.write(data)

        received = 0
        try:
            pieces: list[bytes] = []
            pending = 0
            async for piece in request.stream():
                piece = _corrupt_if_asked(app, piece, received == 0)
                received += len(piece)
                if received > limit:
                    raise AttemptInputError(
                        f"chunk at offset {offset} is longer than {limit} bytes (chunk_bytes="
                        f"{chunk_bytes}, {upload.size_bytes - offset} bytes left to send)"
                    )
                pieces.append(piece)
                pending += len(piece)
                if pending >= WRITE_BLOCK_BYTES:
                    await _in_thread(put, b"".join(pieces))
                    pieces, pending = [], 0
            if pieces:
                await _in_thread(put, b"".join(pieces))
            if received == 0 and upload.size_bytes > offset:
                raise AttemptInputError("empty chunk: send the bytes from received_bytes on")
            if digest.hexdigest() != chunk_sha256:
                raise AttemptInputError(
                    f"chunk at offset {offset} ({received} bytes) does not match its "
                    f"{wire.CHUNK_SHA256_HEADER}: nothing kept, send it again"
                )
            await _in_thread(writer.commit)
        except (Exception, ClientDisconnect):
            await _in_thread(writer.abort)
            raise

        def advance() -> wire.UploadStatus:
            with _fenced(ref), _db(request).session() as session:
                moved = advance_upload(
                    session, ref.job_id, ref.attempt, upload_id, offset=offset, length=received,
                    chunk_bytes=chunk_bytes,
                )  # fmt: skip
                return _status(moved, chunk_bytes)

        status: wire.UploadStatus = await _in_thread(advance)
        if running is not None:
            hashes.keep(upload_id, offset + received, running)
        else:  # bytes this process did not follow: the commit reads the file back
            hashes.forget(upload_id)
    return _json(status)


@router.post(
    wire.UPLOAD_COMMIT_PATH,
    status_code=201,
    response_model=wire.CheckpointEntry,
    summary="Commit a complete upload as a checkpoint",
    responses={
        200: {"model": wire.CheckpointEntry, "description": "Committed before"},
        409: {"description": "Not every byte arrived (detail: the UploadStatus), or superseded"},
        422: {"description": "The file's sha256 does not match: the upload is discarded"},
    },
)
async def commit_upload_route(
    request: Request, ref: AttemptDep, upload_id: UploadIdPath
) -> Response:
    """Verify the whole file's sha256 as the store holds it, then write the checkpoint's row
    and mark the upload committed in one transaction (the row is the only "latest"
    pointer), and apply retention. A repeated commit answers 200 with the same entry.

    Caller: a rank holding the attempt token, for its own job's uploads (another job's: 404);
    409 ``attempt superseded`` when the attempt is not current; 409 with the UploadStatus
    while bytes are missing; 422 when the sha256 does not match (the upload is abandoned, a
    job event says so: begin it again).
    """
    app: FastAPI = request.app
    stores = checkpoint_stores(app)
    hashes = upload_hashes(app)
    chunk_bytes = _chunk_bytes(request)

    def commit() -> tuple[wire.CheckpointEntry, bool]:
        with _db(request).session(write=False) as session:
            with _fenced(ref):
                current_state(session, ref)
            upload = get_upload(session, ref.job_id, upload_id)
            if upload.state == COMMITTED:
                return _entry(get_checkpoint(session, ref.job_id, upload.step)), False
            check_chunk_offset(upload, ref.attempt, upload.size_bytes, chunk_bytes)
        store = stores[upload.store]
        key = upload_key(upload)
        # Hashed as the chunks arrived when this process took them all; else read back.
        sha256 = hashes.whole(upload_id, upload.size_bytes)
        if sha256 is not None and store.received_size(key) != upload.size_bytes:
            sha256 = None  # the store lost bytes since: check what it holds now
        if sha256 is None:
            try:
                sha256 = store.partial_sha256(key)
            except OSError as exc:
                raise CheckpointStoreError(f"cannot read upload {upload_id} back: {exc}") from None
        hashes.forget(upload_id)
        if sha256 != upload.sha256:
            with _fenced(ref), _db(request).session() as session:
                abandon_upload(
                    session,
                    ref.job_id,
                    ref.attempt,
                    upload_id,
                    reason=f"the uploaded file's sha256 {sha256} is not {upload.sha256} "
                    "(corrupted on the way): upload discarded",
                )
            store.discard(key)
            raise AttemptInputError(
                f"upload {upload_id}: the file's sha256 is {sha256}, not {upload.sha256}; "
                "the upload is discarded: begin it again"
            )
        location = store.finalize(key)
        with _fenced(ref), _db(request).session() as session:
            ckpt, doomed = commit_upload(
                session, ref.job_id, ref.attempt, upload_id, location=location
            )
            entry = _entry(ckpt)
        delete_files(stores, doomed)
        return entry, True

    async with _upload_lock(app, upload_id):
        entry, created = await _in_thread(commit)
    return _json(entry, 201 if created else 200)
