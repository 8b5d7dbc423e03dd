"""ASGI middleware of the API: the request body size limit, and gzip for what is read."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from fastapi.responses import JSONResponse
from starlette.middleware.gzip import GZipMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.errors import HTTP_STATUS_CODES, error_body

log = logging.getLogger(__name__)


class BodySizeLimit:
    """ASGI middleware: answer 413 to a request body over ``max_bytes`` bytes, before the app
    sees any of it (checked on Content-Length and again while the body streams in).

    PUTs and POSTs to a path matching ``exempt`` pass untouched and unbuffered: routes that
    stream their body and enforce a cap of their own (checkpoint and workspace file chunks,
    batches of small workspace files).
    ``larger`` gives ``(method, path regex, max_bytes)`` of requests allowed a bigger body
    (a workspace's manifest)."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        exempt: re.Pattern[str] | None = None,
        larger: Sequence[tuple[str, re.Pattern[str], int]] = (),
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.exempt = exempt
        self.larger = tuple(larger)

    def _limit(self, scope: Scope) -> int:
        for method, path, max_bytes in self.larger:
            if scope["method"] == method and path.match(scope["path"]) is not None:
                return max_bytes
        return self.max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._exempt(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self._limit(scope)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await self._reject(scope, send, limit)
            return
        if declared in (None, b"0") and b"transfer-encoding" not in headers:
            # No body (RFC 9112 §6.3), e.g. every GET: nothing to count or replay.
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > limit:
                await self._reject(scope, send, limit)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    def _exempt(self, scope: Scope) -> bool:
        return (
            scope["type"] == "http"
            and scope["method"] in ("PUT", "POST")
            and self.exempt is not None
            and self.exempt.match(scope["path"]) is not None
        )

    async def _reject(self, scope: Scope, send: Send, limit: int) -> None:
        log.warning("rejected %s %s: body over %d bytes", scope["method"], scope["path"], limit)
        response = JSONResponse(
            error_body(
                f"request body exceeds {limit} bytes (DDPQ_MAX_BODY_BYTES)",
                HTTP_STATUS_CODES[413],
            ),
            status_code=413,
            headers={"Connection": "close"},
        )
        await response(scope, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


class ReadsGZip:
    """Starlette's ``GZipMiddleware`` (its ``minimum_size`` in bytes, ``compresslevel`` and
    ``exclude_content_types``) for GET and HEAD requests only: what is read (pages, lists,
    curves) is what is big; the ranks' and workers' POSTs (metric batches, claims,
    heartbeats: the hot paths) get small answers and skip its per-request wrapping."""

    def __init__(
        self,
        app: ASGIApp,
        minimum_size: int,
        compresslevel: int,
        exclude_content_types: tuple[str, ...],
    ) -> None:
        self.app = app
        self.gzip = GZipMiddleware(
            app,
            minimum_size=minimum_size,
            compresslevel=compresslevel,
            exclude_content_types=exclude_content_types,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in ("GET", "HEAD"):
            await self.gzip(scope, receive, send)
        else:
            await self.app(scope, receive, send)
