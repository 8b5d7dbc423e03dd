"""The attempt API's workspace reads (``service.core.wire.workspace``, routes 5–6): the
manifest of the workspace the job's spec names, and each of its files, streamed from
whichever store holds it (``Range: bytes=N-`` resumes, the sha256 in ``X-Ddpq-Sha256``).

Who may call it: only a holder of an attempt token, for its own job, while its attempt is the
job's current, active one (else 409 ``attempt superseded``); a user or API token is 401. A
job whose spec names no workspace answers 404, and so does a file not in its manifest.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Request
from fastapi.responses import StreamingResponse

from service.api.attempts.downloads import FILE_RESPONSES
from service.api.attempts.routes import ERRORS, _db
from service.api.deps import REQUIRE_ATTEMPT, AttemptDep
from service.api.files import stream_file, workspace_stores
from service.core.wire import workspace as wire
from service.store.workspaces import service as workspaces

router = APIRouter(tags=["attempts"], dependencies=[REQUIRE_ATTEMPT], responses=ERRORS)
Sha256Path = Annotated[
    str, Path(pattern=wire.SHA256_PATTERN, description="The file's sha256 (hex).")
]


@router.get(
    wire.ATTEMPT_WORKSPACE_PATH,
    response_model=wire.Manifest,
    summary="The manifest of the job's workspace",
    responses={404: {"description": "The job's spec names no workspace, or it is gone"}},
)
def attempt_workspace_route(request: Request, ref: AttemptDep) -> wire.Manifest:
    """The manifest of the workspace the job's spec names (``workspace``): what a rank lays
    out as its working directory. Reading it keeps the workspace from retention a while.

    Caller: a rank holding the attempt token, for its own job only; 409 ``attempt
    superseded`` when the attempt is not current; 404 when the spec names no workspace.
    """
    return workspaces.attempt_manifest(_db(request), ref)


@router.get(
    wire.ATTEMPT_WORKSPACE_FILE_PATH,
    response_class=StreamingResponse,
    response_model=None,
    summary="Download a file of the job's workspace",
    responses=FILE_RESPONSES,
)
def attempt_workspace_file_route(
    request: Request,
    ref: AttemptDep,
    sha256: Sha256Path,
    range_header: Annotated[str | None, Header(alias="Range")] = None,
) -> StreamingResponse:
    """Stream the file with ``sha256`` (``Range: bytes=N-`` resumes); ``X-Ddpq-Sha256``
    carries it to verify before use.

    Caller: a rank holding the attempt token, for its own job only, and only a file the
    job's manifest lists (any other: 404); 409 ``attempt superseded`` when the attempt is
    not current.
    """
    stores = workspace_stores(request.app)
    stored = workspaces.open_attempt_file(_db(request), stores, ref, sha256)
    return stream_file(stores, stored, range_header)
