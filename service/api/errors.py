"""The API's exception handlers: every ddpq error becomes ``{"detail": ...}`` with its own
status (decided here only) and a ``Retry-After`` header when it says when to retry (a rate
limit's 429); request validation errors keep only loc/msg/type; 405 lists every allowed
method."""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.routing import Match

from service.core.errors import DdpqError, SpecValidationError

log = logging.getLogger(__name__)

HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


async def _ddpq_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, DdpqError)
    if isinstance(exc, SpecValidationError):
        return JSONResponse({"detail": exc.errors}, status_code=exc.status_code)
    detail = exc.client_detail
    if exc.status_code >= 500 or detail is not exc.detail:
        log.warning("%s %s: %s", request.method, request.url.path, exc.detail)
    headers = None
    if exc.retry_after_s is not None:  # e.g. 429: when the next submission is accepted
        headers = {"Retry-After": str(math.ceil(exc.retry_after_s))}
    return JSONResponse({"detail": detail}, status_code=exc.status_code, headers=headers)


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


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers above on ``app``."""
    app.add_exception_handler(DdpqError, _ddpq_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(405, _method_not_allowed)
