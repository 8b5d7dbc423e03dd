"""The checkpoint store interface: where checkpoint bytes live, whatever the hosts share.

A store keeps two kinds of object: *partial uploads* (the bytes of one ``checkpoint_uploads``
row received so far, keyed by its id) and *committed files* (named by a ``location`` string
the store hands out at ``finalize`` and the ``checkpoints`` row keeps). The database rows
are the truth about both: a store never decides what is committed or live, it only holds
bytes. Backends: ``filesystem.FilesystemStore`` (the artifact directory) and
``database.DatabaseStore`` (chunked rows); ``service.store.checkpoints.stores`` builds them
from the settings. ``docs/architecture.md`` says how an object store (S3 multipart) maps
onto these methods.

Every method is synchronous and may block on I/O: call them from a worker thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from service.core.errors import DdpqError

# Bytes a streamed read yields at a time.
READ_BLOCK_BYTES = 1 << 20


class CheckpointStoreError(DdpqError):
    """A store could not hold or give back bytes (a full disk, a missing partial file)."""

    status_code = 503
    code = "checkpoint_store"


class CheckpointTooLargeError(DdpqError):
    """A checkpoint bigger than the store accepts (``DDPQ_CHECKPOINT_DB_MAX_BYTES``)."""

    status_code = 413
    code = "checkpoint_too_large"


@dataclass(frozen=True)
class UploadKey:
    """What a store needs to know of an upload: its id, job and step (the final name)."""

    upload_id: int
    job_id: int
    step: int


class ChunkWriter(Protocol):
    """Receives one chunk at a given offset of a partial upload, streamed piece by piece.

    ``commit`` makes the chunk part of the partial (durable as the backend makes it);
    ``abort`` drops whatever this writer wrote. Exactly one of them is called."""

    def write(self, data: bytes) -> None:
        """Append ``data`` to this chunk."""

    def commit(self) -> None:
        """Keep the chunk."""

    def abort(self) -> None:
        """Drop the chunk (the partial stays as it was before this writer opened)."""


class CheckpointStore(Protocol):
    """One backend of checkpoint bytes (see the module docstring)."""

    name: str

    def begin(self, key: UploadKey) -> None:
        """Start an empty partial for ``key`` (idempotent)."""

    def max_size_bytes(self) -> int | None:
        """The largest file this store accepts, or None for no limit of its own."""

    def open_chunk(self, key: UploadKey, offset: int) -> ChunkWriter:
        """A writer of the chunk starting at byte ``offset``. Bytes held at or beyond
        ``offset`` (left by an interrupted chunk) are dropped first.

        Raises:
            CheckpointStoreError: the partial holds fewer than ``offset`` bytes.
        """

    def received_size(self, key: UploadKey) -> int:
        """How many bytes the partial really holds (0 when it is gone): the database's
        ``received_bytes`` may run ahead of it after a crash, never the other way round."""

    def partial_sha256(self, key: UploadKey) -> str:
        """The sha256 (hex) of the partial's bytes, read back from the store."""

    def finalize(self, key: UploadKey) -> str:
        """Turn the complete partial into a committed file; its ``location``."""

    def put_files(self, files: Sequence[tuple[UploadKey, bytes]]) -> list[str]:
        """Store many whole small files at once, each as ``begin`` + one chunk +
        ``finalize`` would (durable when this returns), at a lower cost per file: their
        ``location`` in order. For a batch of workspace files (a few MiB in all).

        Raises:
            CheckpointStoreError: a file could not be written (some may have been: the
                caller discards every key of the batch).
        """

    def open_read(self, location: str, start: int = 0) -> Iterator[bytes]:
        """The committed file at ``location`` from byte ``start``, in blocks.

        Raises:
            NotFoundError: nothing at ``location`` (deleted, or never there).
        """

    def size(self, location: str) -> int | None:
        """The committed file's size in bytes, or None when it is missing."""

    def delete(self, location: str) -> None:
        """Remove a committed file (idempotent: a missing one is fine)."""

    def discard(self, key: UploadKey) -> None:
        """Remove a partial upload's bytes (idempotent)."""
