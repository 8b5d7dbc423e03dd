"""Checkpoint files: the atomic write (temp file, fsync, rename), their sha256, and loading
one back. No API calls here: ``worker.runtime.checkpoints.saver`` records, uploads and rotates."""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from service.core import artifacts
from service.core.errors import DdpqError

_READ_CHUNK_BYTES = 1 << 20


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_READ_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointWriteError(DdpqError):
    """A checkpoint file could not be written (full disk, I/O error, unpicklable state)."""

    status_code = 500
    code = "checkpoint_write_failed"


def describe_write_error(exc: BaseException) -> str:
    """A one-line reason for a failed write, naming the OS error when there is one.

    ``torch.save`` reports a failed ``write`` as a bare RuntimeError ("unexpected pos …") with
    the real ``OSError`` (e.g. ENOSPC) only as its ``__context__``; this digs it out.
    """
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return f"{type(seen).__name__}: {seen}"
        seen = seen.__cause__ or seen.__context__
    return f"{type(exc).__name__}: {exc}"


def write_temp_checkpoint(state: dict[str, Any], final_path: Path) -> tuple[Path, int, str]:
    """``torch.save`` ``state`` to a temp file next to ``final_path`` and fsync it.

    Returns:
        ``(temp_path, size_bytes, sha256)``; rename it to ``final_path`` to publish it.
    Raises:
        CheckpointWriteError: the write failed (e.g. ``ENOSPC``); no temp file is left.
    """
    tmp = artifacts.temporary_path(final_path)
    try:
        final_path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        return tmp, tmp.stat().st_size, file_sha256(tmp)
    except Exception as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise CheckpointWriteError(describe_write_error(exc)) from exc


def publish_checkpoint(tmp: Path, final_path: Path) -> None:
    """Atomically rename the temp file into place and make the rename durable."""
    os.replace(tmp, final_path)
    _fsync_dir(final_path.parent)


def load_checkpoint_file(path: Path, device: torch.device, *, any_object: bool = False) -> Any:
    """Load one of our own checkpoint files onto ``device`` (weights_only=False: it holds RNG
    states and optimizer state written by ddpq itself, or what a script saved with
    ``ddpq.save_checkpoint``: ``any_object`` then accepts what is not a dict).

    Raises:
        ValueError: not a dict (unless ``any_object``).
    """
    state = torch.load(path, map_location=device, weights_only=False)
    if not any_object and not isinstance(state, dict):
        raise ValueError(f"{path} does not hold a checkpoint dict")
    return state
