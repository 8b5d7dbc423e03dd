"""Checkpoint files: the atomic write (temp file, fsync, rename), a consistent copy of a file
another process writes (a followed checkpoint), their sha256, and loading one back. No API
calls here: ``worker.runtime.checkpoints.saver`` records, uploads and rotates."""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import zipfile
from pathlib import Path
from typing import Any

import torch

from service.core import artifacts
from service.core.errors import DdpqError
from worker.runtime.checkpoints.leases import release_lease, take_read_lease

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


class VersionGoneError(CheckpointWriteError):
    """The version of a followed file that completed is no longer there to copy: the file
    vanished, or the script is already writing the next version (which will be taken)."""


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


# A file's version as the follower knows it: ``(st_dev, st_ino, st_size, st_mtime_ns,
# st_ctime_ns)``. A rewrite in place changes the times, a rename into place the inode.
FileVersion = tuple[int, int, int, int, int]


def file_version(st: os.stat_result) -> FileVersion:
    """The ``FileVersion`` of a ``stat`` answer."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def copy_hashed(
    source: Path, dest: Path, *, follow_symlinks: bool = False, version: FileVersion | None = None
) -> tuple[int, str]:
    """Copy the regular file ``source`` to ``dest`` (created or truncated) while hashing it,
    and fsync ``dest``: one version of ``source``, though another process may write it.

    While the copy runs a read lease is held on ``source`` where the kernel grants one
    (``worker.runtime.checkpoints.leases``): a writer's ``open`` waits until the copy is done,
    so the bytes cannot change under it. Without a lease, a change of size or mtime during the
    copy is caught instead.

    Args:
        follow_symlinks: False (a followed file of the user's): ``source`` itself must not be
            a symbolic link.
        version: the version to copy (the one whose completion was seen); another one there
            now means the script wrote a newer version before this copy began.
    Returns:
        ``(size_bytes, sha256)`` of the copy.
    Raises:
        VersionGoneError: ``source`` vanished, is being written again, or is no longer
            ``version`` (a newer version replaced it: that one is taken on its own event).
        CheckpointWriteError: ``source`` is not a regular file, or changed during the copy;
            or ``dest`` could not be written.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(source, flags | os.O_NONBLOCK)  # O_NONBLOCK: a fifo does not hang us
    except FileNotFoundError:
        raise VersionGoneError(f"{source} vanished before it was copied") from None
    except OSError as exc:
        reason = describe_write_error(exc)  # ELOOP: a symbolic link
        raise CheckpointWriteError(f"{source} cannot be read: {reason}") from None
    with open(fd, "rb") as src:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            raise CheckpointWriteError(f"{source} is not a regular file")
        if version is not None and file_version(before) != version:
            raise VersionGoneError(f"{source} was replaced by a newer version before its copy")
        leased = take_read_lease(fd)
        if leased is False:
            raise VersionGoneError(
                f"{source} is open for writing by another process (a newer version is on its way)"
            )
        digest, size_bytes = hashlib.sha256(), 0
        try:
            with open(dest, "wb") as out:
                while chunk := src.read(_READ_CHUNK_BYTES):
                    out.write(chunk)
                    digest.update(chunk)
                    size_bytes += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            after = os.fstat(fd)
        except OSError as exc:
            raise CheckpointWriteError(describe_write_error(exc)) from exc
        finally:
            if leased:
                release_lease(fd)
    if size_bytes != before.st_size or (after.st_size, after.st_mtime_ns) != (
        before.st_size,
        before.st_mtime_ns,
    ):
        raise CheckpointWriteError(
            f"{source} changed while it was copied ({before.st_size} bytes at the start, "
            f"{size_bytes} copied, {after.st_size} at the end)"
        )
    return size_bytes, digest.hexdigest()


ZIP_MAGIC = b"PK\x03\x04"


def looks_torn(path: Path) -> bool:
    """Whether ``path`` begins as a zip archive (what ``torch.save`` writes) but has no
    intact end (``zipfile.is_zipfile`` finds no end-of-central-directory record): a save cut
    short by a crash, whose file the kernel closed anyway. Other formats: False (nothing to
    tell by)."""
    try:
        with open(path, "rb") as fh:
            if fh.read(len(ZIP_MAGIC)) != ZIP_MAGIC:
                return False
    except OSError:
        return False
    return not zipfile.is_zipfile(path)


def write_temp_copy(
    source: Path, final_path: Path, version: FileVersion | None = None
) -> tuple[Path, int, str]:
    """Copy the followed file ``source`` (``version`` of it, when given) to a temp file next
    to ``final_path``, hashed and fsynced (``copy_hashed``): what ``write_temp_checkpoint``
    is for a state dict.

    Returns:
        ``(temp_path, size_bytes, sha256)``; rename it to ``final_path`` to publish it.
    Raises:
        CheckpointWriteError: see ``copy_hashed``; no temp file is left.
    """
    tmp = artifacts.temporary_path(final_path)
    try:
        final_path.parent.mkdir(parents=True, exist_ok=True)
        size_bytes, sha256 = copy_hashed(source, tmp, version=version)
    except (OSError, CheckpointWriteError) as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, CheckpointWriteError):
            raise
        raise CheckpointWriteError(describe_write_error(exc)) from exc
    return tmp, size_bytes, sha256


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
