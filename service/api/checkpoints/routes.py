"""Routes of a job's checkpoints: the list and the download of one file."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Request
from fastapi.responses import StreamingResponse

from service.api.deps import REQUIRE_CALLER, UNAUTHORIZED, ContextDep
from service.api.files import checkpoint_stores, stream_file
from service.api.http import ERRORS, MAX_INT64, JobIdPath
from service.api.schemas import CheckpointListOut, checkpoint_out
from service.core.artifacts import checkpoint_download_name
from service.store.checkpoints import service as checkpoints

router = APIRouter(tags=["checkpoints"], dependencies=[REQUIRE_CALLER], responses=UNAUTHORIZED)


@router.get(
    "/jobs/{job_id}/checkpoints",
    response_model=CheckpointListOut,
    summary="A job's checkpoints",
    responses=ERRORS,
)
def checkpoints_route(job_id: JobIdPath, ctx: ContextDep) -> CheckpointListOut:
    """Committed, live (not deleted by retention) checkpoints, newest step first; ``path`` is
    relative to the server's artifact directory. A partial upload is never listed. Caller:
    the job's owner or an admin (anyone else: 404)."""
    root = ctx.settings.resolved_artifact_dir
    found = checkpoints.list_job_checkpoints(ctx.db, job_id, owner=ctx.owner)
    return CheckpointListOut(checkpoints=[checkpoint_out(c, root) for c in found])


@router.get(
    "/jobs/{job_id}/checkpoints/{step}/file",
    response_class=StreamingResponse,
    response_model=None,
    summary="Download a checkpoint file",
    responses={
        200: {"content": {"application/octet-stream": {}}},
        206: {"description": "From the ``Range: bytes=N-`` start on"},
        416: {"description": "The range starts beyond the file"},
        **ERRORS,
    },
)
def checkpoint_file_route(
    request: Request,
    job_id: JobIdPath,
    step: Annotated[int, Path(ge=0, le=MAX_INT64, description="Global step.")],
    ctx: ContextDep,
    range_header: Annotated[str | None, Header(alias="Range")] = None,
) -> StreamingResponse:
    """The committed checkpoint at ``step``, streamed from whichever store holds it
    (``Range: bytes=N-`` resumes); ``X-Ddpq-Sha256`` (and ``X-Checkpoint-Sha256``) carry its
    sha256. Caller: the job's owner or an admin (anyone else: 404, as for a job that does
    not exist); an attempt token is 401."""
    stores = checkpoint_stores(request.app)
    stored = checkpoints.open_job_checkpoint(ctx.db, stores, job_id, step, owner=ctx.owner)
    return stream_file(
        stores, stored, range_header, filename=checkpoint_download_name(job_id, step)
    )
