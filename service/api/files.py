"""Streaming a committed checkpoint file out of its store, for the user download route and
the ranks' resume and init_from downloads: ``Range: bytes=N-`` resumes, the sha256 rides in a
header so the receiver verifies before use. Never the whole file in memory."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass

from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse

from service.core.errors import DdpqError, NotFoundError
from service.core.wire.attempt import SHA256_HEADER
from service.store.checkpoints.backends.base import (
    CheckpointStore,
    CheckpointStoreError,
    make_stores,
)
from service.store.checkpoints.backends.filesystem import FilesystemStore
from service.store.models import Checkpoint

log = logging.getLogger(__name__)

RANGE_RE = re.compile(r"^\s*bytes=(\d{1,19})-\s*$")
# The header the user download has always carried (kept beside SHA256_HEADER).
LEGACY_SHA256_HEADER = "X-Checkpoint-Sha256"


class StoredFileDamagedError(DdpqError):
    """The store holds another number of bytes than the checkpoint's row recorded (the file
    was truncated or replaced behind the service's back): no byte of it is served."""

    status_code = 410
    code = "checkpoint_damaged"


@dataclass(frozen=True)
class StoredFile:
    """What streaming one checkpoint needs, read from its row inside a session."""

    store: str
    location: str
    size_bytes: int
    sha256: str

    @classmethod
    def of(cls, ckpt: Checkpoint) -> StoredFile:
        """The row's store, location, size and sha256."""
        return cls(ckpt.store, ckpt.location or ckpt.path, ckpt.size_bytes, ckpt.sha256)


def checkpoint_stores(app: FastAPI) -> dict[str, CheckpointStore]:
    """The app's checkpoint stores by name, built on first use (``make_stores``)."""
    stores: dict[str, CheckpointStore] | None = getattr(app.state, "checkpoint_stores", None)
    if stores is None:
        stores = app.state.checkpoint_stores = make_stores(app.state.settings, app.state.db)
    return stores


def upload_store(app: FastAPI) -> CheckpointStore:
    """The store new uploads go to (``DDPQ_CHECKPOINT_STORE``)."""
    return checkpoint_stores(app)[app.state.settings.checkpoint_store]


def filesystem_store_id(app: FastAPI) -> str | None:
    """The filesystem store's id when uploads go there (a rank whose artifact root holds the
    same id shares this filesystem); None for another store."""
    store = upload_store(app)
    if not isinstance(store, FilesystemStore):
        return None
    try:
        return store.store_id()
    except CheckpointStoreError as exc:
        # No id to compare with: every rank uploads, which works whatever the hosts share.
        log.warning("no checkpoint store id: %s", exc.detail)
        return None


def range_start(header: str | None, size_bytes: int) -> int:
    """The first byte a ``Range`` header asks for (0 without one; only ``bytes=N-`` is
    understood, anything else is ignored as RFC 9110 allows).

    Raises:
        HTTPException: 416 when ``N`` lies beyond the file.
    """
    if not header:
        return 0
    match = RANGE_RE.match(header)
    if match is None:
        return 0
    start = int(match.group(1))
    if start >= size_bytes and not start == size_bytes == 0:
        raise HTTPException(
            416,
            f"range starts at byte {start} of a {size_bytes}-byte file",
            headers={"Content-Range": f"bytes */{size_bytes}"},
        )
    return start


def stream_file(
    stores: Mapping[str, CheckpointStore],
    stored: StoredFile,
    range_header: str | None,
    *,
    filename: str | None = None,
) -> StreamingResponse:
    """The file as a streamed response: 200 whole, or 206 from a ``Range: bytes=N-`` start,
    with ``Content-Length``, ``Accept-Ranges`` and the sha256 (of the whole file) headers.

    Raises:
        NotFoundError: the store has no such file any more (404).
        StoredFileDamagedError: the store's file is not of the recorded size (410, before
            any byte: a body cut short of its ``Content-Length`` would look like a network
            fault, and the receiver would retry it).
        HTTPException: 416 for a range beyond the file.
    """
    store = stores.get(stored.store)
    if store is None:
        raise NotFoundError(f"checkpoint store {stored.store!r} is not available here")
    held = store.size(stored.location)
    if held is None:
        raise NotFoundError("checkpoint file not found")
    if held != stored.size_bytes:
        raise StoredFileDamagedError(
            f"stored file is {held} bytes, recorded {stored.size_bytes}: the checkpoint is "
            "damaged, use an earlier one"
        )
    start = range_start(range_header, stored.size_bytes)
    blocks = store.open_read(stored.location, start)
    headers = {
        "Content-Length": str(stored.size_bytes - start),
        "Accept-Ranges": "bytes",
        SHA256_HEADER: stored.sha256,
        LEGACY_SHA256_HEADER: stored.sha256,
    }
    if filename is not None:
        headers["Content-Disposition"] = f'attachment; filename="{filename}"'
    status = 200
    if start:
        status = 206
        headers["Content-Range"] = f"bytes {start}-{stored.size_bytes - 1}/{stored.size_bytes}"
    return StreamingResponse(
        blocks, status_code=status, media_type="application/octet-stream", headers=headers
    )
