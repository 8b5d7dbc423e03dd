"""The attempt API's checkpoint downloads: a committed checkpoint of the job (resume on a host
without the file) and the one its ``init_from`` names, streamed from whichever store holds
it, ``Range: bytes=N-`` to resume, the sha256 in ``X-Ddpq-Sha256``.

Who may call it: only a holder of an attempt token, for its own job, while its attempt is the
job's current, active one (else 409 ``attempt superseded``); a user or API token is 401.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Request
from fastapi.responses import StreamingResponse

from service.api.attempts.routes import ERRORS, _db
from service.api.deps import REQUIRE_ATTEMPT, AttemptDep
from service.api.files import checkpoint_stores, stream_file
from service.core.wire import attempt as wire
from service.store.checkpoints import service as checkpoints

router = APIRouter(tags=["attempts"], dependencies=[REQUIRE_ATTEMPT], responses=ERRORS)
StepPath = Annotated[int, Path(ge=0, le=wire.MAX_STEP, description="Global step.")]


FILE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/octet-stream": {}}, "description": "The whole file"},
    206: {"description": "From the ``Range: bytes=N-`` start on"},
    404: {"description": "No such live checkpoint of this job"},
    416: {"description": "The range starts beyond the file"},
}


@router.get(
    wire.CHECKPOINT_FILE_PATH,
    response_class=StreamingResponse,
    response_model=None,
    summary="Download a committed checkpoint of the job (resume)",
    responses=FILE_RESPONSES,
)
def checkpoint_file_route(
    request: Request,
    ref: AttemptDep,
    step: StepPath,
    range_header: Annotated[str | None, Header(alias="Range")] = None,
) -> StreamingResponse:
    """Stream the job's committed checkpoint at ``step`` (``Range: bytes=N-`` resumes); the
    ``X-Ddpq-Sha256`` header carries the sha256 to verify before use. The checkpoint is
    then this attempt's resume point: retention keeps it until the attempt commits a newer
    one.

    Caller: a rank holding the attempt token, for its own job only; 409 ``attempt
    superseded`` when the attempt is not current; 404 when no live checkpoint is at ``step``.
    """
    stores = checkpoint_stores(request.app)
    stored = checkpoints.open_resume_checkpoint(_db(request), stores, ref, step)
    return stream_file(stores, stored, range_header)


@router.get(
    wire.INIT_FILE_PATH,
    response_class=StreamingResponse,
    response_model=None,
    summary="Download the checkpoint the job's init_from names",
    responses=FILE_RESPONSES,
)
def init_file_route(
    request: Request,
    ref: AttemptDep,
    range_header: Annotated[str | None, Header(alias="Range")] = None,
) -> StreamingResponse:
    """Stream the source checkpoint of the job's ``init_from`` (resolved at submit, where the
    job's owner was checked against the source job's); headers as for a resume download.

    Caller: a rank holding the attempt token, for its own job only; 409 ``attempt
    superseded`` when the attempt is not current; 404 when the job has no ``init_from`` or
    the checkpoint is gone.
    """
    stores = checkpoint_stores(request.app)
    stored = checkpoints.open_init_from_checkpoint(_db(request), stores, ref)
    return stream_file(stores, stored, range_header)
