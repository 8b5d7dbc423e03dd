"""Streaming a committed file over HTTP: a checkpoint for the user download route and the ranks'
resume and init_from downloads, a workspace file for the ranks. ``Range: bytes=N-`` resumes,
the sha256 rides in a header so the receiver verifies before use. Never the whole file in
memory. Which file, and whether
its store still holds it whole, is the store's use cases' (``service.store.checkpoints``)."""

from __future__ import annotations

import re

from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse

from service.core.wire.attempt import SHA256_HEADER
from service.store.checkpoints.stores import CheckpointStores, read_stored
from service.store.checkpoints.values import StoredFile

RANGE_RE = re.compile(r"^\s*bytes=(\d{1,19})-\s*$")
# The header the user download has always carried (kept beside SHA256_HEADER).
LEGACY_SHA256_HEADER = "X-Checkpoint-Sha256"


def checkpoint_stores(app: FastAPI) -> CheckpointStores:
    """The app's checkpoint stores by name (``create_app`` builds them from its settings)."""
    stores: CheckpointStores = app.state.checkpoint_stores
    return stores


def workspace_stores(app: FastAPI) -> CheckpointStores:
    """The app's workspace file stores by name (the same backends over their own places,
    ``service.store.workspaces.stores``; ``create_app`` builds them)."""
    stores: CheckpointStores = app.state.workspace_stores
    return stores


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
    stores: CheckpointStores,
    stored: StoredFile,
    range_header: str | None,
    *,
    filename: str | None = None,
) -> StreamingResponse:
    """A verified stored file (a use case's ``StoredFile``) as a streamed response: 200 whole,
    or 206 from a ``Range: bytes=N-`` start, with ``Content-Length``, ``Accept-Ranges`` and
    the sha256 (of the whole file) headers.

    Raises:
        HTTPException: 416 for a range beyond the file.
        NotFoundError: the file went away since it was verified (404).
    """
    start = range_start(range_header, stored.size_bytes)
    blocks = read_stored(stores, stored, start)
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
