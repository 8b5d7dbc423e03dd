"""The chunks of a checkpoint upload on their way into the store, and the running sha256 of
each upload while they arrive.

A ``ChunkReceiver`` takes one chunk, written piece by piece as the request body streams in
(never the whole chunk or file in memory beyond the caller's write blocks), hashed on the
way, kept only when complete and matching its sha256. ``upload_service.open_chunk`` checks
the upload and opens one; ``upload_service.finish_chunk`` commits it and counts it in the
upload's row. The receiver touches no database: between the two, only the store's bytes move.

``UploadHashes`` lets the commit compare the whole file's sha256 without reading the file
back from its store. Per API process, in memory: the digest of an upload's first
``received_bytes`` bytes, moved on only by a chunk this process stored and counted (chunks
arrive in order: ``offset`` is always ``received_bytes``). Whatever this process cannot vouch
for — it restarted, another process took some chunks, the status was lowered after a loss —
has no entry (or one at another byte count) and the commit reads the file back instead
(``partial_sha256``).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any

from service.core.wire.attempt import CHUNK_SHA256_HEADER
from service.store.checkpoints.backends.base import ChunkWriter
from service.store.checkpoints.checks import CheckpointInputError

# Uploads followed at once per process; the least recently moved one is forgotten first
# (its commit then reads the file back).
MAX_UPLOADS = 1024


class UploadHashes:
    """Running digests by upload id (thread-safe)."""

    def __init__(self, limit: int = MAX_UPLOADS) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._by_id: OrderedDict[int, tuple[int, Any]] = OrderedDict()

    def resume(self, upload_id: int, offset: int) -> Any | None:
        """A digest of the upload's bytes before ``offset`` to continue with the chunk at
        ``offset`` (a copy: the kept one moves only by ``keep``); None when unknown."""
        if offset == 0:
            return hashlib.sha256()
        with self._lock:
            held = self._by_id.get(upload_id)
            if held is None or held[0] != offset:
                return None
            return held[1].copy()

    def keep(self, upload_id: int, received_bytes: int, digest: Any) -> None:
        """Remember ``digest`` as that of the upload's first ``received_bytes`` bytes."""
        with self._lock:
            self._by_id[upload_id] = (received_bytes, digest)
            self._by_id.move_to_end(upload_id)
            while len(self._by_id) > self._limit:
                self._by_id.popitem(last=False)

    def whole(self, upload_id: int, size_bytes: int) -> str | None:
        """The hex sha256 of the whole file when this process followed every byte of it."""
        with self._lock:
            held = self._by_id.get(upload_id)
        if held is None or held[0] != size_bytes:
            return None
        return str(held[1].copy().hexdigest())

    def forget(self, upload_id: int) -> None:
        """Drop the upload's digest (committed, or discarded)."""
        with self._lock:
            self._by_id.pop(upload_id, None)


class ChunkReceiver:
    """The bytes of one chunk at ``offset`` of upload ``upload_id``, at most ``limit`` long.

    Call ``count`` for each piece as it arrives (cheap: no I/O), ``write`` with the pieces
    (blocking: in a worker thread), then ``commit`` once, or ``abort`` on any failure
    (``abort`` after a ``commit`` does nothing).
    """

    def __init__(
        self,
        *,
        upload_id: int,
        offset: int,
        size_bytes: int,
        chunk_bytes: int,
        writer: ChunkWriter,
        hashes: UploadHashes,
    ) -> None:
        self.upload_id = upload_id
        self.offset = offset
        self.size_bytes = size_bytes
        self.chunk_bytes = chunk_bytes
        self.limit = min(chunk_bytes, size_bytes - offset)
        self.received = 0
        self._writer = writer
        self._hashes = hashes
        self._digest = hashlib.sha256()
        self._running: Any | None = hashes.resume(upload_id, offset)  # the whole file's so far
        self._committed = False

    def count(self, length: int) -> None:
        """Count ``length`` more bytes of the body before they are written.

        Raises:
            CheckpointInputError: the chunk is now longer than ``limit`` (422, nothing kept).
        """
        self.received += length
        if self.received > self.limit:
            raise CheckpointInputError(
                f"chunk at offset {self.offset} is longer than {self.limit} bytes (chunk_bytes="
                f"{self.chunk_bytes}, {self.size_bytes - self.offset} bytes left to send)"
            )

    def write(self, data: bytes) -> None:
        """Hash ``data`` and write it into the store (blocking)."""
        self._digest.update(data)
        if self._running is not None:
            self._running.update(data)
        self._writer.write(data)

    def commit(self, chunk_sha256: str) -> None:
        """Keep the chunk in the store, once it is complete and matches ``chunk_sha256``.

        Raises:
            CheckpointInputError: empty while bytes are left to send, or another sha256 (422;
                the caller then aborts, nothing is kept).
        """
        if self.received == 0 and self.size_bytes > self.offset:
            raise CheckpointInputError("empty chunk: send the bytes from received_bytes on")
        if self._digest.hexdigest() != chunk_sha256:
            raise CheckpointInputError(
                f"chunk at offset {self.offset} ({self.received} bytes) does not match its "
                f"{CHUNK_SHA256_HEADER}: nothing kept, send it again"
            )
        self._writer.commit()
        self._committed = True

    def abort(self) -> None:
        """Drop what this chunk wrote (nothing once committed)."""
        if not self._committed:
            self._writer.abort()

    def remember(self) -> None:
        """After the upload's row counted the chunk: keep the whole file's running digest, or
        forget it when this process did not follow every earlier byte (the commit then
        reads the file back)."""
        if self._running is not None:
            self._hashes.keep(self.upload_id, self.offset + self.received, self._running)
        else:
            self._hashes.forget(self.upload_id)
