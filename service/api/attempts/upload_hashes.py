"""The running sha256 of each checkpoint upload while its chunks arrive, so the commit
compares the whole file's sha256 without reading the file back from its store.

Per API process, in memory: the digest of an upload's first ``received_bytes`` bytes, moved
on only by a chunk this process stored and counted (chunks arrive in order: ``offset`` is
always ``received_bytes``). Whatever this process cannot vouch for — it restarted, another
process took some chunks, the status was lowered after a loss — has no entry (or one at
another byte count) and the commit reads the file back instead (``partial_sha256``).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any

from fastapi import FastAPI

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


def upload_hashes(app: FastAPI) -> UploadHashes:
    """The app's running digests, made on first use."""
    hashes: UploadHashes | None = getattr(app.state, "upload_hashes", None)
    if not isinstance(hashes, UploadHashes):
        hashes = app.state.upload_hashes = UploadHashes()
    return hashes
