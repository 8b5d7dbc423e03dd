"""The filesystem checkpoint store: files under the API's artifact directory.

Layout (``service.core.artifacts``): a partial upload is
``jobs/<id>/checkpoints/.upload-<upload_id>.part``; ``finalize`` fsyncs it and renames it to
``jobs/<id>/checkpoints/step-<step>.upload-<upload_id>.pt``, whose path relative to the root
is the ``location``. That name is the upload's own, never ``step-<step>.pt`` (the name a rank
sharing this filesystem writes, or another upload of the same step finalized): a finalize
whose commit is then refused (the attempt superseded) overwrites no committed file, and its
file is dropped with the abandoned upload (``discard``). The root holds
``STORE_ID_FILE`` with a random id, so a rank can tell whether its artifact directory is
this one (the same id) or another host's (it must upload).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import secrets
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, cast

from service.core.artifacts import (
    checkpoint_dir,
    checkpoint_name,
    confine,
    parse_uploaded_checkpoint_name,
    upload_partial_name,
    uploaded_checkpoint_name,
)
from service.core.errors import NotFoundError
from service.core.wire.attempt import STORE_ID_FILE
from service.store.checkpoints.backends.base import (
    READ_BLOCK_BYTES,
    CheckpointStoreError,
    UploadKey,
)


def _fsync_dir(path: Path) -> None:
    # A rename is durable once its directory is synced.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.cache
def _syncfs() -> Callable[[int], int] | None:
    """Linux's ``syncfs(fd)`` (not in ``os``), or None where libc has none."""
    try:
        found = getattr(ctypes.CDLL(None, use_errno=True), "syncfs", None)
    except OSError:
        return None
    if found is None:
        return None
    found.argtypes, found.restype = [ctypes.c_int], ctypes.c_int
    return cast("Callable[[int], int]", found)


def _sync_batch(paths: Sequence[Path]) -> None:
    """Make the files ``paths`` (written, renamed into place) and their directories durable.

    One ``syncfs`` of their filesystem where Linux has it: a single journal commit for the
    whole batch, where an fsync per file cost 0.5–4 ms each on a shared disk (1–8 s for a
    2,000-file workspace). Elsewhere, an fsync per file, then per directory once.
    """
    sync = _syncfs()
    dirs = sorted({p.parent for p in paths})
    if sync is not None and dirs:
        fd = os.open(dirs[0], os.O_RDONLY)
        try:
            if sync(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
        finally:
            os.close(fd)
        return
    for path in paths:
        with path.open("rb") as f:
            os.fsync(f.fileno())
    for d in dirs:
        _fsync_dir(d)


class _FileChunk:
    """A chunk written straight into the partial file at its offset."""

    def __init__(self, f: BinaryIO, offset: int) -> None:
        self._f = f
        self._offset = offset

    def write(self, data: bytes) -> None:
        self._f.write(data)

    def commit(self) -> None:
        # Flushed to the page cache: a killed API process loses nothing; a crash of the
        # host may, and then ``received_size`` reports the shorter file (finalize fsyncs).
        self._f.close()

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._f.truncate(self._offset)
        self._f.close()


class FilesystemStore:
    """Checkpoint bytes as files under ``root`` (the resolved artifact directory)."""

    name = "filesystem"

    def __init__(self, root: Path) -> None:
        self.root = root

    # -- identity -------------------------------------------------------------------------

    def store_id(self) -> str:
        """The id in ``root/STORE_ID_FILE``, written (randomly, once) on first use.

        Raises:
            CheckpointStoreError: the root cannot be written or read.
        """
        path = self.root / STORE_ID_FILE
        try:
            return path.read_text().strip()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise CheckpointStoreError(f"cannot read {path}: {exc}") from None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:  # another process won the race: its id counts
            return path.read_text().strip()
        except OSError as exc:
            raise CheckpointStoreError(f"cannot write {path}: {exc}") from None
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(16))
        return path.read_text().strip()

    # -- partial uploads ------------------------------------------------------------------

    def _partial(self, key: UploadKey) -> Path:
        return checkpoint_dir(self.root, key.job_id) / upload_partial_name(key.upload_id)

    def _final(self, key: UploadKey) -> Path:
        name = uploaded_checkpoint_name(key.step, key.upload_id)
        return checkpoint_dir(self.root, key.job_id) / name

    def _held(self, key: UploadKey) -> Path:
        """The upload's bytes: the partial, or its finalized file once renamed (the API may
        stop between the rename and the commit: a retried commit finds the bytes there)."""
        partial = self._partial(key)
        final = self._final(key)
        return final if not partial.exists() and final.exists() else partial

    def max_size_bytes(self) -> int | None:
        return None

    def begin(self, key: UploadKey) -> None:
        path = self._partial(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(exist_ok=True)
        except OSError as exc:
            raise CheckpointStoreError(f"cannot start upload file {path.name}: {exc}") from None

    def open_chunk(self, key: UploadKey, offset: int) -> _FileChunk:
        path = self._partial(key)
        try:
            f = path.open("r+b")
        except FileNotFoundError:
            raise CheckpointStoreError(
                f"upload {key.upload_id}'s partial file is gone: start the upload again"
            ) from None
        size = os.fstat(f.fileno()).st_size
        if size < offset:
            f.close()
            raise CheckpointStoreError(
                f"upload {key.upload_id} holds {size} bytes, not {offset}: resume from GET status"
            )
        f.truncate(offset)
        f.seek(offset)
        return _FileChunk(f, offset)

    def received_size(self, key: UploadKey) -> int:
        try:
            return self._held(key).stat().st_size
        except OSError:
            return 0

    def partial_sha256(self, key: UploadKey) -> str:
        with self._held(key).open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()

    def finalize(self, key: UploadKey) -> str:
        partial, final = self._partial(key), self._final(key)
        try:
            if partial.exists() or not final.exists():  # else finalized before (idempotent)
                with partial.open("rb+") as f:
                    os.fsync(f.fileno())
                os.replace(partial, final)
            _fsync_dir(final.parent)
        except OSError as exc:
            raise CheckpointStoreError(f"cannot finalize upload {key.upload_id}: {exc}") from None
        return final.relative_to(self.root).as_posix()

    def put_files(self, files: Sequence[tuple[UploadKey, bytes]]) -> list[str]:
        finals: list[Path] = []
        try:
            for key, data in files:
                partial, final = self._partial(key), self._final(key)
                if not finals or partial.parent != finals[-1].parent:
                    partial.parent.mkdir(parents=True, exist_ok=True)
                # Written whole as a partial, then renamed: a final name only ever holds a
                # whole file, as after ``finalize``.
                partial.write_bytes(data)
                os.replace(partial, final)
                finals.append(final)
            _sync_batch(finals)
        except OSError as exc:
            raise CheckpointStoreError(
                f"cannot store a batch of {len(files)} files: {exc}"
            ) from None
        return [final.relative_to(self.root).as_posix() for final in finals]

    def discard(self, key: UploadKey) -> None:
        # Only for an upload that never committed (abandoned): its finalized file, if the
        # API got that far, is no row's location.
        for path in (self._partial(key), self._final(key)):
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)

    # -- committed files ------------------------------------------------------------------

    def _resolve(self, location: str, *, must_exist: bool = True) -> Path:
        stored = Path(location)
        return confine(
            self.root, stored if stored.is_absolute() else self.root / stored, must_exist=must_exist
        )

    def open_read(self, location: str, start: int = 0) -> Iterator[bytes]:
        f = self._resolve(location).open("rb")  # opened now: a missing file raises here
        f.seek(start)

        def blocks() -> Iterator[bytes]:
            with f:
                while block := f.read(READ_BLOCK_BYTES):
                    yield block

        return blocks()

    def size(self, location: str) -> int | None:
        try:
            return self._resolve(location).stat().st_size
        except (NotFoundError, OSError):
            return None

    def delete(self, location: str) -> None:
        with contextlib.suppress(NotFoundError, OSError):
            path = self._resolve(location, must_exist=False)
            path.unlink(missing_ok=True)
            # A rank sharing this directory may have linked ``step-<n>.pt`` to an uploaded
            # file (``worker.runtime.checkpoints.fetch``): that link goes with its target.
            uploaded = parse_uploaded_checkpoint_name(path.name)
            canonical = path.with_name(checkpoint_name(uploaded[0])) if uploaded else None
            linked = canonical is not None and canonical.is_symlink()
            if canonical is not None and linked and os.readlink(canonical) == path.name:
                canonical.unlink()
