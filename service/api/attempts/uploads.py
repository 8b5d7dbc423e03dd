"""The attempt API's checkpoint uploads: in chunks from rank 0 into the checkpoint store,
committed once verified (``service.core.wire.attempt`` describes the protocol; the ranks'
downloads are ``downloads``). The routes move the HTTP side (the body streamed in, one
chunk or commit of an upload at a time in this process); the use cases
(``service.store.checkpoints.upload_service`` and ``service.commit_upload``) check, write and
commit.

Who may call it: only a holder of an attempt token, for its own job, while its attempt is the
job's current, active one (else 409 ``attempt superseded``); a user or API token is 401
(``deps.get_attempt``). An upload id of another job is "not found" (404), as is a
checkpoint of another job: the token names the job, no route takes one.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Header, Path, Query, Request, Response

from service.api.attempts.checkpoints import checkpoint_entry
from service.api.attempts.routes import (
    ERRORS,
    AttemptInputError,
    _body_doc,
    _db,
    _in_thread,
    _json_body,
)
from service.api.chunks import receive_chunk, upload_lock
from service.api.deps import REQUIRE_ATTEMPT, AttemptDep
from service.api.files import checkpoint_stores
from service.core.owners.quotas import QuotaLimits
from service.core.wire import attempt as wire
from service.store.checkpoints import service as checkpoints
from service.store.checkpoints import upload_service as uploads
from service.store.checkpoints.upload_service import ChunkReceiver, UploadHashes
from service.store.checkpoints.values import UploadStatus

router = APIRouter(tags=["attempts"], dependencies=[REQUIRE_ATTEMPT], responses=ERRORS)

UploadIdPath = Annotated[int, Path(ge=1, le=2**63 - 1, description="The upload's id.")]
StepPath = Annotated[int, Path(ge=0, le=wire.MAX_STEP, description="Global step.")]


def _chunk_bytes(request: Request) -> int:
    return int(request.app.state.settings.checkpoint_chunk_bytes)


def _status_json(status: UploadStatus, status_code: int = 200) -> Response:
    return _json(wire.UploadStatus(**asdict(status)), status_code)


def _json(model: Any, status_code: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status_code, media_type="application/json")


def upload_hashes(app: FastAPI) -> UploadHashes:
    """The app's running digests of uploads (this process's), made on first use."""
    hashes: UploadHashes | None = getattr(app.state, "upload_hashes", None)
    if not isinstance(hashes, UploadHashes):
        hashes = app.state.upload_hashes = UploadHashes()
    return hashes


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
        413: {
            "description": "Bigger than the store accepts (DDPQ_CHECKPOINT_DB_MAX_BYTES), or "
            "than the job's or owner's checkpoint quota leaves (DDPQ_CHECKPOINT_JOB_MAX_BYTES, "
            "DDPQ_CHECKPOINT_OWNER_MAX_BYTES): a failed save"
        },
        429: {
            "description": "The owner has DDPQ_UPLOADS_IN_FLIGHT_PER_OWNER uploads under way: "
            "begin again after `Retry-After` seconds"
        },
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
    ``received_bytes``). Older pending uploads of the job are abandoned. ``file_name`` (a
    followed checkpoint's workspace file) goes to the checkpoint's row at the commit.

    Caller: a rank holding the attempt token (nobody else); 409 ``attempt superseded`` when
    the attempt is not current; 413 when the store caps files below ``size_bytes`` or the
    job's or owner's checkpoint quota has no room for them (a ``quota_exceeded`` event);
    429 with ``Retry-After`` when the owner has too many uploads under way.
    """
    settings = request.app.state.settings
    begun = await _in_thread(
        lambda: uploads.begin_upload(
            _db(request),
            checkpoint_stores(request.app),
            ref,
            step=start.step,
            epoch=start.epoch,
            size_bytes=start.size_bytes,
            sha256=start.sha256,
            store_name=settings.checkpoint_store,
            chunk_bytes=settings.checkpoint_chunk_bytes,
            file_name=start.file_name,
            limits=QuotaLimits.from_settings(settings),
        )
    )
    return _status_json(begun.status, 201 if begun.created else 200)


@router.get(wire.UPLOAD_PATH, response_model=wire.UploadStatus, summary="Where an upload stands")
def upload_status_route(request: Request, ref: AttemptDep, upload_id: UploadIdPath) -> Response:
    """The upload's status: resume at ``received_bytes`` (what the store really holds, which
    may be less than the last answer said if the API was killed meanwhile).

    Caller: a rank holding the attempt token, for its own job's uploads (another job's: 404);
    409 ``attempt superseded`` when the attempt is not current.
    """
    status = uploads.read_upload_status(
        _db(request),
        checkpoint_stores(request.app),
        ref,
        upload_id,
        chunk_bytes=_chunk_bytes(request),
    )
    return _status_json(status)


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
    db = _db(request)
    stores = checkpoint_stores(app)
    hashes = upload_hashes(app)

    async with upload_lock(app, "checkpoint", upload_id):
        receiver: ChunkReceiver = await _in_thread(
            lambda: uploads.open_chunk(
                db, stores, hashes, ref, upload_id, offset=offset, chunk_bytes=chunk_bytes
            )
        )
        status: UploadStatus = await receive_chunk(
            request,
            receiver,
            lambda: uploads.finish_chunk(db, ref, receiver, chunk_sha256),
            transform=lambda piece, first: _corrupt_if_asked(app, piece, first),
        )
    return _status_json(status)


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
    db, stores, hashes = _db(request), checkpoint_stores(app), upload_hashes(app)
    chunk_bytes = _chunk_bytes(request)

    async with upload_lock(app, "checkpoint", upload_id):
        done = await _in_thread(
            lambda: checkpoints.commit_upload(
                db, stores, hashes, ref, upload_id, chunk_bytes=chunk_bytes
            )
        )
    return _json(checkpoint_entry(done.checkpoint), 201 if done.created else 200)
