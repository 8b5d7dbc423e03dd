"""Route of a job's rank logs: text from a byte offset, with the offset to continue from."""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import ValidationError

from service.api.deps import REQUIRE_CALLER, UNAUTHORIZED, ContextDep
from service.api.http import ERRORS, MAX_INT64, JobIdPath
from service.api.schemas import LogsOut
from service.core.artifacts import confine, rank_log_path
from service.core.errors import NotFoundError
from service.core.spec.model import JobSpec
from service.store.jobs.crud import get_job

router = APIRouter(tags=["logs"], dependencies=[REQUIRE_CALLER], responses=UNAUTHORIZED)

# Most bytes one call returns.
MAX_LOG_CHUNK_BYTES = 256 * 1024


def read_log_chunk(
    path: Path, offset: int, max_bytes: int = MAX_LOG_CHUNK_BYTES
) -> tuple[str, int, bool]:
    """Up to ``max_bytes`` bytes of ``path`` from byte ``offset``, decoded as UTF-8.

    A multi-byte character cut at the end of the chunk is left for the next call; bytes that
    are not UTF-8 become U+FFFD.

    Returns:
        ``(text, next_offset, eof)``; a missing file gives ``("", offset, True)``.
    """
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(min(offset, size))
            data = f.read(max_bytes) if offset < size else b""
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return "", offset, True
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text = decoder.decode(data, final=False)
    pending = len(decoder.getstate()[0])
    end = offset + len(data)
    return text, end - pending, end >= size


def _world_size(stored_spec: dict[str, object]) -> int | None:
    """The ranks of a stored spec; None if it no longer validates (then no rank is refused)."""
    try:
        return JobSpec.model_validate(stored_spec).world_size
    except ValidationError:
        return None


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
    with ctx.db.session(write=False) as session:
        job = get_job(session, job_id, owner=ctx.owner)
        current_attempt = job.attempt
        stored_spec = job.spec
    if attempt is not None and attempt > current_attempt:
        attempts = "only attempt 1" if current_attempt == 1 else f"attempts 1–{current_attempt}"
        raise NotFoundError(f"job {job_id} has {attempts}; there is no attempt {attempt}")
    attempt = attempt or current_attempt
    world_size = _world_size(stored_spec)
    if world_size is not None and rank >= world_size:
        ranks = "only rank 0" if world_size == 1 else f"ranks 0–{world_size - 1}"
        raise NotFoundError(f"job {job_id} has {ranks}; there is no rank {rank}")
    root = ctx.settings.resolved_artifact_dir
    path = confine(root, rank_log_path(root, job_id, attempt, rank), must_exist=False)
    text, next_offset, eof = read_log_chunk(path, offset)
    return LogsOut(text=text, next_offset=next_offset, rank=rank, attempt=attempt, eof=eof)
