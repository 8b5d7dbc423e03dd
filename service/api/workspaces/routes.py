"""Routes of the workspace resource (``service.core.wire.workspace``, routes 1–4): which files
the caller lacks, each missing file's chunked upload, storing a manifest, reading one back.

Who may call: any caller with a user API token (or anyone with auth off, as the default
owner), on their own workspaces, files and uploads only: another owner's digest or upload
answers the same 404 as one that does not exist, and a file another owner uploaded counts as
missing. Admins too see only their own. An attempt token is 401 (``deps.get_context``).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Header, Path, Query, Request, Response
from starlette.convertors import Convertor, register_url_convertor

from service.api.bodies import body_doc, json_body
from service.api.chunks import in_thread, receive_chunk, upload_lock
from service.api.deps import REQUIRE_CALLER, UNAUTHORIZED, ContextDep
from service.api.files import workspace_stores
from service.api.http import MAX_INT64, json_response
from service.core.owners.quotas import QuotaLimits
from service.core.wire import batch
from service.core.wire import workspace as wire
from service.core.wire.attempt import CHUNK_SHA256_HEADER, MAX_SIZE_BYTES
from service.store.workspaces import service as workspaces
from service.store.workspaces import upload_service as uploads
from service.store.workspaces.upload_service import ChunkReceiver, UploadHashes
from service.store.workspaces.values import FileUploadState

router = APIRouter(
    tags=["workspaces"],
    dependencies=[REQUIRE_CALLER],
    responses={
        **UNAUTHORIZED,
        422: {"description": "Invalid input: `detail` lists {loc, msg, type} per bad field"},
    },
)


class Sha256Convertor(Convertor[str]):
    """A path part that is a sha256 (64 lowercase hex): ``/workspaces/{digest}`` must not
    match ``/workspaces/files`` or ``/workspaces/missing`` (their ``Allow`` would list GET)."""

    regex = "[0-9a-f]{64}"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("sha256", Sha256Convertor())
# The contract's path, its digest matched only as a sha256 (the OpenAPI path stays the same).
WORKSPACE_ROUTE = wire.WORKSPACE_PATH.replace("{digest}", "{digest:sha256}")
# An upload's id is a number: ``/workspaces/files/batch`` is another route, not an upload
# (else OPTIONS/GET there would advertise and try this one).
FILE_UPLOAD_ROUTE = wire.FILE_UPLOAD_PATH.replace("{upload_id}", "{upload_id:int}")

UploadIdPath = Annotated[int, Path(ge=1, le=MAX_INT64, description="The upload's id.")]
DigestPath = Annotated[
    str, Path(pattern=wire.SHA256_PATTERN, description="The workspace's digest (sha256 hex).")
]
UPLOAD_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"description": "No such upload of yours (`code`: not_found)"},
}
WORKSPACE_NOT_FOUND = (
    f"No such workspace of yours (`code`: {workspaces.WorkspaceNotFoundError.code})"
)


def workspace_hashes(app: FastAPI) -> UploadHashes:
    """The app's running digests of workspace uploads (their ids overlap checkpoint ones)."""
    hashes: UploadHashes | None = getattr(app.state, "workspace_upload_hashes", None)
    if not isinstance(hashes, UploadHashes):
        hashes = app.state.workspace_upload_hashes = UploadHashes()
    return hashes


def _chunk_bytes(ctx: ContextDep) -> int:
    return int(ctx.settings.checkpoint_chunk_bytes)


def _status(state: FileUploadState, status_code: int = 200) -> Response:
    return json_response(wire.FileUploadStatus(**asdict(state)), status_code)


@router.post(
    wire.MISSING_PATH,
    response_model=wire.MissingAnswer,
    summary="Which of these files the server lacks for you",
    responses={422: {"description": "A malformed body, or more than MAX_MISSING_FILES files"}},
    openapi_extra=body_doc(wire.MissingFiles),
)
def missing_files_route(
    asked: Annotated[wire.MissingFiles, json_body(wire.MissingFiles)], ctx: ContextDep
) -> wire.MissingAnswer:
    """The sha256 of each listed file you have not uploaded (upload these), each once.

    Caller: a user (the default owner with auth off); only the caller's own files count, a
    file another owner uploaded is missing. An attempt token is 401.
    """
    return wire.MissingAnswer(
        missing=workspaces.missing_files(ctx.db, ctx.caller.owner, asked.files)
    )


@router.post(
    wire.FILES_PATH,
    status_code=201,
    response_model=wire.FileUploadStatus,
    summary="Begin (or resume) a workspace file upload",
    responses={
        200: {"model": wire.FileUploadStatus, "description": "Begun before, or you have it"},
        413: {
            "description": "The file alone is over DDPQ_WORKSPACE_MAX_BYTES, or the store's "
            "cap, or your stored files leave no room for it (DDPQ_WORKSPACE_OWNER_MAX_BYTES)"
        },
        429: {
            "description": "You have DDPQ_UPLOADS_IN_FLIGHT_PER_OWNER uploads under way: "
            "begin again after `Retry-After` seconds"
        },
    },
    openapi_extra=body_doc(wire.FileUploadStart),
)
def begin_file_route(
    request: Request,
    start: Annotated[wire.FileUploadStart, json_body(wire.FileUploadStart)],
    ctx: ContextDep,
) -> Response:
    """Begin the upload of one file: 201 with its status; 200 with the same upload when you
    began this sha256 before and did not finish (resume at ``received_bytes``), or with a
    ``committed`` status when you have the file already. An empty file is begun, then
    committed, with no chunk.

    Caller: a user (the default owner with auth off), for their own files. An attempt token
    is 401.
    """
    settings = ctx.settings
    begun = uploads.begin_file_upload(
        ctx.db,
        workspace_stores(request.app),
        ctx.caller.owner,
        sha256=start.sha256,
        size_bytes=start.size_bytes,
        store_name=settings.checkpoint_store,
        chunk_bytes=settings.checkpoint_chunk_bytes,
        max_bytes=settings.workspace_max_bytes,
        limits=QuotaLimits.from_settings(settings),
    )
    return _status(begun.status, 201 if begun.created else 200)


@router.post(
    wire.FILES_BATCH_PATH,
    response_model=batch.BatchAnswer,
    summary="Upload many small workspace files at once",
    responses={
        413: {"description": "The body is over the chunk cap (DDPQ_CHECKPOINT_CHUNK_BYTES)"},
        422: {"description": "The body does not split into the files its header lists"},
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {batch.BATCH_CONTENT_TYPE: {"schema": {"type": "string"}}},
        }
    },
)
async def file_batch_route(request: Request, ctx: ContextDep) -> batch.BatchAnswer:
    """Keep many whole small files (each at most ``BATCH_FILE_MAX_BYTES``) sent in one body:
    a JSON line listing each file's sha256 and size, then their bytes in that order
    (``service.core.wire.batch``). Answers which files you now have and each one refused
    with its reason (its bytes do not match its sha256: nothing of it kept).

    Caller: a user (the default owner with auth off), for their own files: a file another
    owner has counts for nothing here. An attempt token is 401. 413 for a body over the
    chunk cap (plus the header's); 422 for a body that does not split into its files.
    """
    settings = ctx.settings
    cap = batch.batch_body_cap(settings.checkpoint_chunk_bytes)
    too_large = batch.BatchTooLargeError(batch.too_large_message(settings.checkpoint_chunk_bytes))
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise too_large
    pieces: list[bytes] = []
    received = 0
    async for piece in request.stream():  # counted as it arrives: no more than cap is held
        received += len(piece)
        if received > cap:
            raise too_large
        pieces.append(piece)
    body = b"".join(pieces)
    db, stores, owner = ctx.db, workspace_stores(request.app), ctx.caller.owner

    def store_batch() -> batch.BatchAnswer:
        kept = uploads.store_file_batch(
            db, stores, owner, batch.split_batch(body, settings.checkpoint_chunk_bytes),
            store_name=settings.checkpoint_store, max_bytes=settings.workspace_max_bytes,
            limits=QuotaLimits.from_settings(settings),
        )  # fmt: skip
        refused = [batch.BatchRefusal(sha256=s, reason=r) for s, r in kept.refused]
        return batch.BatchAnswer(stored=kept.stored, refused=refused)

    return await in_thread(store_batch)


@router.get(
    FILE_UPLOAD_ROUTE,
    response_model=wire.FileUploadStatus,
    summary="Where a workspace file upload stands",
    responses=UPLOAD_ERRORS,
)
def file_status_route(request: Request, upload_id: UploadIdPath, ctx: ContextDep) -> Response:
    """The upload's status: resume at ``received_bytes`` (what the store really holds).

    Caller: the user who began the upload (anyone else: 404). An attempt token is 401.
    """
    state = uploads.read_file_upload(
        ctx.db, workspace_stores(request.app), ctx.caller.owner, upload_id,
        chunk_bytes=_chunk_bytes(ctx),
    )  # fmt: skip
    return _status(state)


@router.put(
    wire.FILE_CHUNK_PATH,
    response_model=wire.FileUploadStatus,
    summary="Send one chunk of a workspace file",
    responses={
        **UPLOAD_ERRORS,
        409: {"description": "Not at this offset, or not receiving (detail: the status)"},
        422: {"description": "The body does not match its sha256, or is too big: send again"},
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/octet-stream": {"schema": {"type": "string"}}},
        }
    },
)
async def file_chunk_route(
    request: Request,
    upload_id: UploadIdPath,
    offset: Annotated[int, Query(ge=0, le=MAX_SIZE_BYTES, description="Byte offset.")],
    chunk_sha256: Annotated[
        str,
        Header(
            alias=CHUNK_SHA256_HEADER,
            pattern=wire.SHA256_PATTERN,
            description="sha256 (hex) of the body.",
        ),
    ],
    ctx: ContextDep,
) -> Response:
    """Store the body (raw bytes, at most ``chunk_bytes``, streamed into the store) at
    ``offset``, once it matched its sha256; then ``received_bytes`` moves on.

    Caller: the user who began the upload (anyone else: 404). An attempt token is 401. 409
    with the status when ``offset`` is not ``received_bytes``; 422 (nothing kept) for a
    body too big or not matching ``X-Ddpq-Chunk-Sha256``.
    """
    app: FastAPI = request.app
    chunk_bytes = _chunk_bytes(ctx)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > chunk_bytes:
        raise uploads.ChunkTooLargeError(
            f"chunk of {declared} bytes exceeds chunk_bytes={chunk_bytes}"
        )
    db, stores, hashes, owner = (
        ctx.db,
        workspace_stores(app),
        workspace_hashes(app),
        ctx.caller.owner,
    )
    async with upload_lock(app, "workspace", upload_id):
        receiver: ChunkReceiver = await in_thread(
            lambda: uploads.open_file_chunk(
                db, stores, hashes, owner, upload_id, offset=offset, chunk_bytes=chunk_bytes
            )
        )
        state = await receive_chunk(
            request, receiver, lambda: uploads.finish_file_chunk(db, owner, receiver, chunk_sha256)
        )
    return _status(state)


@router.post(
    wire.FILE_COMMIT_PATH,
    response_model=wire.FileUploadStatus,
    summary="Commit a complete workspace file",
    responses={
        **UPLOAD_ERRORS,
        409: {"description": "Bytes are missing, or abandoned (detail: the status)"},
        422: {"description": "The file's sha256 does not match: the upload is discarded"},
    },
)
async def commit_file_route(request: Request, upload_id: UploadIdPath, ctx: ContextDep) -> Response:
    """Verify the whole file's size and sha256 as the store holds it, then keep it as your
    file: ``committed`` (again for a repeated commit).

    Caller: the user who began the upload (anyone else: 404). An attempt token is 401. 409
    with the status while bytes are missing; 422 when the sha256 does not match (the
    upload is discarded: begin it again).
    """
    app: FastAPI = request.app
    db, stores, hashes, owner = (
        ctx.db,
        workspace_stores(app),
        workspace_hashes(app),
        ctx.caller.owner,
    )
    chunk_bytes = _chunk_bytes(ctx)
    async with upload_lock(app, "workspace", upload_id):
        state = await in_thread(
            lambda: uploads.commit_file_upload(
                db, stores, hashes, owner, upload_id, chunk_bytes=chunk_bytes
            )
        )
    return _status(state)


@router.post(
    wire.WORKSPACES_PATH,
    status_code=201,
    response_model=wire.WorkspaceSummary,
    summary="Store a workspace's manifest",
    responses={
        200: {"model": wire.WorkspaceSummary, "description": "You had this digest already"},
        413: {"description": "Over DDPQ_WORKSPACE_MAX_BYTES or DDPQ_WORKSPACE_MAX_FILES"},
        422: {"description": "A bad manifest, or files not uploaded (one error per file)"},
    },
    openapi_extra=body_doc(wire.WorkspaceCreate),
)
def create_workspace_route(
    body: Annotated[wire.WorkspaceCreate, json_body(wire.WorkspaceCreate)], ctx: ContextDep
) -> Response:
    """Store a manifest whose files you all uploaded, under its digest (what a job spec's
    ``workspace`` names): 201, or 200 for a digest you had. 422 lists each file not
    uploaded (``loc`` into the body); 413 names the limit and the largest files.

    Caller: a user (the default owner with auth off), with their own files. An attempt token
    is 401.
    """
    stored = workspaces.create_workspace(
        ctx.db,
        ctx.caller.owner,
        body.manifest,
        max_bytes=ctx.settings.workspace_max_bytes,
        max_files=ctx.settings.workspace_max_files,
    )
    summary = wire.WorkspaceSummary(
        digest=stored.digest, file_count=stored.file_count, total_bytes=stored.total_bytes
    )
    return json_response(summary, 201 if stored.created else 200)


@router.get(
    WORKSPACE_ROUTE,
    response_model=wire.Manifest,
    summary="A workspace's manifest",
    responses={404: {"description": WORKSPACE_NOT_FOUND}},
)
def get_workspace_route(digest: DigestPath, ctx: ContextDep) -> wire.Manifest:
    """The manifest stored under ``digest``.

    Caller: the user who stored it (anyone else: 404, as for a digest nobody stored). An
    attempt token is 401.
    """
    return workspaces.get_manifest(ctx.db, ctx.caller.owner, digest)
