"""Routes of a job's checkpoints: the list and the download of one file."""

from __future__ import annotations

from pathlib import Path as FsPath
from typing import Annotated

from fastapi import APIRouter, Path
from fastapi.responses import FileResponse

from service.api.deps import REQUIRE_CALLER, UNAUTHORIZED, ContextDep
from service.api.jobs import ERRORS, MAX_INT64, JobIdPath
from service.api.schemas import CheckpointListOut, checkpoint_out
from service.core.artifacts import confine
from service.store.checkpoints import get_checkpoint, list_checkpoints
from service.store.jobs import get_job

router = APIRouter(tags=["checkpoints"], dependencies=[REQUIRE_CALLER], responses=UNAUTHORIZED)


@router.get(
    "/jobs/{job_id}/checkpoints",
    response_model=CheckpointListOut,
    summary="A job's checkpoints",
    responses=ERRORS,
)
def checkpoints_route(job_id: JobIdPath, ctx: ContextDep) -> CheckpointListOut:
    """Live (not rotated away) checkpoints, newest step first; ``path`` is relative to the
    server's artifact directory."""
    root = ctx.settings.resolved_artifact_dir
    with ctx.db.session(write=False) as session:
        get_job(session, job_id, owner=ctx.owner)
        return CheckpointListOut(
            checkpoints=[checkpoint_out(c, root) for c in list_checkpoints(session, job_id)]
        )


@router.get(
    "/jobs/{job_id}/checkpoints/{step}/file",
    response_class=FileResponse,
    response_model=None,
    summary="Download a checkpoint file",
    responses={200: {"content": {"application/octet-stream": {}}}, **ERRORS},
)
def checkpoint_file_route(
    job_id: JobIdPath,
    step: Annotated[int, Path(ge=0, le=MAX_INT64, description="Global step.")],
    ctx: ContextDep,
) -> FileResponse:
    """The checkpoint file written at ``step`` (only files inside the artifact directory are
    served; a recorded path outside it answers 404)."""
    with ctx.db.session(write=False) as session:
        get_job(session, job_id, owner=ctx.owner)
        ckpt = get_checkpoint(session, job_id, step)
        stored, sha256 = FsPath(ckpt.path), ckpt.sha256
    root = ctx.settings.resolved_artifact_dir
    path = confine(root, stored if stored.is_absolute() else root / stored)
    return FileResponse(
        path,
        media_type="application/octet-stream",
        filename=f"job-{job_id}-step-{step}.pt",
        headers={"X-Checkpoint-Sha256": sha256},
    )
