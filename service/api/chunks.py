"""Receiving one chunk of an upload over HTTP, for every kind of upload (rank 0's checkpoints,
users' workspace files): the request body streamed into a use case's ``ChunkReceiver`` in
blocks (each hashed and written in a worker thread, never the whole chunk at once), kept
only once the use case's ``finish`` accepted it, dropped on any failure or disconnect. One
chunk or commit of an upload at a time in this process (``upload_lock``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI, Request
from starlette.requests import ClientDisconnect

# Bytes of a chunk body gathered before one hash-and-write in a thread (one hop each: at
# 1 MiB the hops cost a fifth of a 16 MiB chunk's time on a 2-core box).
WRITE_BLOCK_BYTES = 4 << 20
# Upload locks kept before the idle ones are dropped.
MAX_LOCKS = 10_000

T = TypeVar("T")


class Receiver(Protocol):
    """What the loop drives of ``service.store.checkpoints.chunks.ChunkReceiver``."""

    @property
    def received(self) -> int: ...
    def count(self, length: int) -> None: ...
    def write(self, data: bytes) -> None: ...
    def abort(self) -> None: ...


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in the loop's default executor (cheaper than anyio's thread hop)."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def upload_lock(app: FastAPI, kind: str, upload_id: int) -> asyncio.Lock:
    """The lock of upload ``upload_id`` of ``kind`` (``checkpoint``, ``workspace``: their ids
    overlap) in this process: two PUTs of one offset would otherwise write the same bytes of
    a partial file at once."""
    locks: dict[tuple[str, int], asyncio.Lock] | None = getattr(app.state, "upload_locks", None)
    if locks is None:
        locks = app.state.upload_locks = {}
    if len(locks) > MAX_LOCKS:
        for key in [k for k, lock in locks.items() if not lock.locked()]:
            del locks[key]
    return locks.setdefault((kind, upload_id), asyncio.Lock())


async def receive_chunk(
    request: Request,
    receiver: Receiver,
    finish: Callable[[], T],
    *,
    transform: Callable[[bytes, bool], bytes] | None = None,
) -> T:
    """Stream ``request``'s body into ``receiver``, then ``finish()`` (in a thread: it checks
    and keeps the chunk, and counts it); on any failure the chunk is aborted and the error
    raised. ``transform(piece, first)`` may alter each piece first (a test's fault).

    Raises:
        Whatever ``receiver.count`` (a chunk too long) or ``finish`` raise; ClientDisconnect.
    """
    try:
        pieces: list[bytes] = []
        pending = 0
        async for piece in request.stream():
            if transform is not None:
                piece = transform(piece, receiver.received == 0)
            receiver.count(len(piece))  # refused past the chunk's length, before any write
            pieces.append(piece)
            pending += len(piece)
            if pending >= WRITE_BLOCK_BYTES:
                await in_thread(receiver.write, b"".join(pieces))
                pieces, pending = [], 0
        if pieces:
            await in_thread(receiver.write, b"".join(pieces))
        return await in_thread(finish)
    except (Exception, ClientDisconnect):
        await in_thread(receiver.abort)  # nothing once the chunk was kept
        raise
