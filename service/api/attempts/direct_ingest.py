"""The metric ingest's direct path: an ASGI middleware that hands a plain metric batch
(``POST {API_PREFIX}{METRICS_PATH}``) to its route function (``routes.metrics_route``)
without the layers every other request passes through.

A batch is the API's most frequent request (every rank 0 sends one per flush), its answer is
small, and its route solves no dependency. The layers it skips (Starlette's exception and
exit-stack middleware, the app's other middleware, the router trying its routes, FastAPI's
request handler) cost about a third of what the event loop spends on a batch around its
store call (~40 of ~125 µs here, the store call stubbed out; ``bench/ingest_cpu.py``). The same
route function answers either way, and an error is answered by the handler the app
registered for it (``errors.install_error_handlers``), so a batch gets the same answer by
both paths (``tests/integration/test_direct_ingest.py`` compares them).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from fastapi import Request, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from service.api.attempts.routes import metrics_route
from service.core.wire import API_PREFIX
from service.core.wire.attempt import METRICS_PATH

# An exception handler as Starlette takes one: a coroutine function, or a plain one.
Handler = Callable[[Request, Exception], Any]


class DirectIngest:
    """ASGI middleware, the outermost of the app's own (``create_app`` adds it last): a
    ``POST`` to the metric path whose body the route can take as it stands goes straight to
    ``metrics_route``; every other request goes on to ``app`` untouched.

    "As it stands" means a declared ``Content-Length`` of at most ``max_bytes`` bytes
    (``DDPQ_MAX_BODY_BYTES``; ``BodySizeLimit`` answers the others with its 413) and no
    ``Content-Encoding`` or ``Transfer-Encoding``. An exception the app has a handler for is
    answered by that handler, as Starlette's ``ExceptionMiddleware`` would (a status code's
    handler first for an ``HTTPException``, then the nearest class in the exception's MRO);
    any other propagates to the server-error layer outside (500, logged).
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.path = API_PREFIX + METRICS_PATH

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and _route_path(scope) == self.path
            and self._as_it_stands(scope["headers"])
        ):
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        response: Response
        try:
            response = await metrics_route(request)
        except ClientDisconnect:
            return  # the rank went before its body came: no one to answer (as BodySizeLimit)
        except Exception as exc:
            handler = _handler_for(scope["app"].exception_handlers, exc)
            if handler is None:
                raise
            if inspect.iscoroutinefunction(handler):
                response = await handler(request, exc)
            else:  # as Starlette runs a plain function handler
                response = await run_in_threadpool(handler, request, exc)
        await response(scope, receive, send)

    def _as_it_stands(self, headers: list[tuple[bytes, bytes]]) -> bool:
        length = None
        for key, value in headers:
            if key == b"content-length":
                length = value
            elif key in (b"content-encoding", b"transfer-encoding"):
                return False
        return length is not None and length.isdigit() and int(length) <= self.max_bytes


def _route_path(scope: Scope) -> str:
    """The path the router matches: ``path`` without the ``root_path`` a proxy or a mount
    put in front of it (as ``starlette.routing`` does)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _handler_for(handlers: dict[Any, Handler], exc: Exception) -> Handler | None:
    """The app's handler for ``exc`` as Starlette's ``ExceptionMiddleware`` picks it, or None
    for one only the server-error layer answers (``Exception`` and 500 are that layer's)."""
    if isinstance(exc, HTTPException) and exc.status_code != 500:
        by_status = handlers.get(exc.status_code)
        if by_status is not None:
            return by_status
    for cls in type(exc).__mro__:
        if cls is Exception:
            return None
        handler = handlers.get(cls)
        if handler is not None:
            return handler
    return None
