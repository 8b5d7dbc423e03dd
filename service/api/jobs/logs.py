"""Route of a job's rank logs: text from a byte offset, with the offset to continue from."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from service.api.deps import REQUIRE_CALLER, UNAUTHORIZED, ContextDep
from service.api.http import ERRORS, MAX_INT64, JobIdPath
from service.api.schemas import LogsOut
from service.store.jobs import service as jobs

router = APIRouter(tags=["logs"], dependencies=[REQUIRE_CALLER], responses=UNAUTHORIZED)


@router.get(
    "/jobs/{job_id}/logs",
    response_model=LogsOut,
    summary="Log text of one rank",
    responses=ERRORS,
)
def logs_route(
    job_id: JobIdPath,
    ctx: ContextDep,
    rank: Annotated[int, Query(ge=0, le=1_000_000, description="Global rank.")] = 0,
    attempt: Annotated[
        int | None, Query(ge=1, le=1_000_000, description="Default: the current attempt.")
    ] = None,
    offset: Annotated[
        int,
        Query(ge=0, le=MAX_INT64, description="Byte offset (``next_offset`` of the last call)."),
    ] = 0,
) -> LogsOut:
    """At most 256 KiB of the rank's log from ``offset``; follow with ``next_offset``.
    A rank the job does not have (``rank`` ≥ its world_size), or an attempt after its current
    one, answers 404 naming its ranks or attempts."""
    chunk = jobs.read_job_log(
        ctx.db,
        job_id,
        owner=ctx.owner,
        rank=rank,
        attempt=attempt,
        offset=offset,
        artifact_dir=ctx.settings.resolved_artifact_dir,
    )
    return LogsOut(
        text=chunk.text,
        next_offset=chunk.next_offset,
        rank=chunk.rank,
        attempt=chunk.attempt,
        eof=chunk.eof,
        found=chunk.found,
    )
