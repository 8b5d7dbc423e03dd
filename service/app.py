"""create_app(settings): the FastAPI application — routers, error handling, body limit, lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy import exc as sa_exc
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api import checkpoints, health, jobs, logs, metrics, workers
from service.api.schemas import job_spec_openapi_schemas
from service.core.config import Settings, get_settings
from service.core.errors import (
    ConflictError,
    DatabaseUnavailableError,
    DdpqError,
    SpecValidationError,
)
from service.store.db import Database, redact_url
from service.store.reaper import reap_forever
from service.web import routes as web_routes

log = logging.getLogger(__name__)

API_PREFIX = "/api/v1"
STATIC_DIR = Path(__file__).resolve().parent / "web" / "static"
HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


class BodySizeLimit:
    """ASGI middleware: answer 413 to a request body over ``max_bytes`` bytes, before the app
    sees any of it (checked on Content-Length and again while the body streams in)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._reject(scope, send)
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
            if total > self.max_bytes:
                await self._reject(scope, send)
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

    async def _reject(self, scope: Scope, send: Send) -> None:
        log.warning(
            "rejected %s %s: body over %d bytes", scope["method"], scope["path"], self.max_bytes
        )
        response = JSONResponse(
            {"detail": f"request body exceeds {self.max_bytes} bytes (DDPQ_MAX_BODY_BYTES)"},
            status_code=413,
            headers={"Connection": "close"},
        )
        await response(scope, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def public_detail(exc: DdpqError) -> Any:
    """What a client is told about ``exc``: a driver error's text (SQL, values, server
    messages) stays in the server's log; the client gets "database unavailable", "database
    error" or "conflicts with stored data"."""
    cause = exc.__cause__
    if not isinstance(cause, sa_exc.SQLAlchemyError):
        return exc.detail
    if isinstance(exc, DatabaseUnavailableError):
        if isinstance(cause, sa_exc.OperationalError | sa_exc.InterfaceError):
            return "database unavailable: try again later"
        return "database error"
    if isinstance(exc, ConflictError):
        return "conflicts with stored data"
    return exc.detail


async def _ddpq_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, DdpqError)
    if isinstance(exc, SpecValidationError):
        return JSONResponse({"detail": exc.errors}, status_code=exc.status_code)
    detail = public_detail(exc)
    if exc.status_code >= 500 or detail is not exc.detail:
        log.warning("%s %s: %s", request.method, request.url.path, exc.detail)
    return JSONResponse({"detail": detail}, status_code=exc.status_code)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    # Only loc/msg/type: the offending input (raw bytes, exceptions in ctx) stays out.
    detail = [
        {
            "loc": [p if isinstance(p, int) else str(p) for p in e.get("loc", ())],
            "msg": str(e.get("msg", "")),
            "type": str(e.get("type", "value_error")),
        }
        for e in exc.errors()
    ]
    return JSONResponse({"detail": detail}, status_code=422)


async def _method_not_allowed(request: Request, exc: Exception) -> JSONResponse:
    """405 whose ``Allow`` lists every method of the path (RFC 9110 §15.5.6): Starlette names
    only the first route that matched it (GET and POST /jobs are two routes)."""
    allowed = [
        method
        for method in HTTP_METHODS
        if any(
            route.matches({**request.scope, "method": method})[0] is Match.FULL
            for route in request.app.router.routes
        )
    ]
    return JSONResponse(
        {"detail": "Method Not Allowed"}, status_code=405, headers={"Allow": ", ".join(allowed)}
    )


def _install_openapi(app: FastAPI) -> None:
    """Generate the OpenAPI document with JobSpec's schema (POST /jobs reads its body raw)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(job_spec_openapi_schemas())
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(settings: Settings | None = None) -> FastAPI:
    """The ddpq API (prefix /api/v1), the dashboard routes and /static.

    Builds the Database for ``settings`` (default: ``get_settings()``) without connecting;
    at startup the lifespan checks the database and refuses to start unless its schema is
    at head.

    Raises (at startup):
        SchemaOutOfDateError: the database is not migrated; run `ddpq db upgrade`.
        DatabaseUnavailableError: the database cannot be reached.
    """
    settings = settings or get_settings()
    db = Database.from_url(settings.resolved_database_url)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        health.check_database(db)
        log.info("serving %s", redact_url(settings.resolved_database_url))
        # Everything imported and built so far lives as long as the process: keep it out of
        # the collector's full passes, each of which stalled a request by ~140 ms (124k
        # objects, 2-core box; bench #5 poll p99). Once per process (tests build many apps).
        if gc.get_freeze_count() == 0:
            gc.freeze()
        reaper = asyncio.create_task(reap_forever(db, settings.heartbeat_interval_s))
        try:
            yield
        finally:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
            db.dispose()

    app = FastAPI(
        title="ddpq",
        version="0.1.0",
        description="Job submission service for distributed PyTorch (DDP) training.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.db = db
    app.add_exception_handler(DdpqError, _ddpq_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(405, _method_not_allowed)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    for module in (jobs, metrics, checkpoints, logs, workers):
        app.include_router(module.router, prefix=API_PREFIX)
    app.include_router(health.router)  # /healthz, /readyz where probes expect them
    app.include_router(health.router, prefix=API_PREFIX)
    app.include_router(web_routes.router)
    if STATIC_DIR.is_dir():
        app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    _install_openapi(app)
    return app
