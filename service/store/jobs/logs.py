"""Reading the rank logs a worker writes under the artifact directory
(``service.core.artifacts.rank_log_path``): text from a byte offset, with the offset to
continue from."""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from service.core.artifacts import confine, rank_log_path
from service.core.errors import NotFoundError
from service.core.spec.model import JobSpec
from service.store.jobs.values import JobView, LogChunk

# Most bytes one call returns.
MAX_LOG_CHUNK_BYTES = 256 * 1024


def read_log_chunk(
    path: Path, offset: int, max_bytes: int = MAX_LOG_CHUNK_BYTES
) -> tuple[str, int, bool, bool]:
    """Up to ``max_bytes`` bytes of ``path`` from byte ``offset``, decoded as UTF-8.

    A multi-byte character cut at the end of the chunk is left for the next call; bytes that
    are not UTF-8 become U+FFFD.

    Returns:
        ``(text, next_offset, eof, found)``; a missing file gives ``("", offset, True, False)``.
    """
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(min(offset, size))
            data = f.read(max_bytes) if offset < size else b""
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return "", offset, True, False
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text = decoder.decode(data, final=False)
    pending = len(decoder.getstate()[0])
    end = offset + len(data)
    return text, end - pending, end >= size, True


def read_rank_log(
    artifact_dir: Path, job: JobView, *, rank: int, attempt: int | None, offset: int
) -> LogChunk:
    """A slice of ``rank``'s log of ``job`` in ``attempt`` (None: its current one) from byte
    ``offset`` (``read_log_chunk``), confined to ``artifact_dir``.

    Raises:
        NotFoundError: an attempt after the job's current one, or a rank it does not have
            (the message names its attempts or ranks).
    """
    if attempt is not None and attempt > job.attempt:
        attempts = "only attempt 1" if job.attempt == 1 else f"attempts 1–{job.attempt}"
        raise NotFoundError(f"job {job.id} has {attempts}; there is no attempt {attempt}")
    attempt = attempt or job.attempt
    world_size = _world_size(job.spec)
    if world_size is not None and rank >= world_size:
        ranks = "only rank 0" if world_size == 1 else f"ranks 0–{world_size - 1}"
        raise NotFoundError(f"job {job.id} has {ranks}; there is no rank {rank}")
    path = confine(
        artifact_dir, rank_log_path(artifact_dir, job.id, attempt, rank), must_exist=False
    )
    text, next_offset, eof, found = read_log_chunk(path, offset)
    return LogChunk(text, next_offset, rank, attempt, eof, found=found)


def _world_size(stored_spec: Any) -> int | None:
    """The ranks of a stored spec; None if it no longer validates (then no rank is refused)."""
    try:
        return JobSpec.model_validate(stored_spec).world_size
    except ValidationError:
        return None
