"""The API's exception handlers: every error answer is ``{"detail": ..., "code": ...}``.

A ddpq error answers with its own status (decided here only), its class's stable ``code``
(clients branch on it, never on the wording) and a ``Retry-After`` header when it says when to
retry (a rate limit's 429); request validation errors keep only loc/msg/type (code
``invalid_request``); Starlette's own errors (an unknown route, a refused token, 405, 416)
get a code from ``HTTP_STATUS_CODES``; 405 lists every allowed method; any other exception
(a bug) is 500 ``internal_error``, its details in the log only."""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from service.core.errors import DdpqError, SpecValidationError

log = logging.getLogger(__name__)

HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
# The code of an error raised as an HTTP status rather than a ddpq error (the router's 404 and
# 405, the token checks' 401, the body limit's 413, a bad Range's 416, the ingest limiter's 429).
HTTP_STATUS_CODES: dict[int, str] = {
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    416: "range_not_satisfiable",
    429: "rate_limited",
}
VALIDATION_CODE = "invalid_request"
INTERNAL_CODE = "internal_error"


def error_body(detail: Any, code: str) -> dict[str, Any]:
    """The JSON body of every error answer: the message (or field list) and a stable code."""
    return {"detail": detail, "code": code}


async def _ddpq_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, DdpqError)
    if isinstance(exc, SpecValidationError):
        return JSONResponse(error_body(exc.errors, exc.code), status_code=exc.status_code)
    detail = exc.client_detail
    if exc.status_code >= 500 or detail is not exc.detail:
        log.warning("%s %s: %s", request.method, request.url.path, exc.detail)
    headers = None
    if exc.retry_after_s is not None:  # e.g. 429: when the next submission is accepted
        headers = {"Retry-After": str(math.ceil(exc.retry_after_s))}
    body = {**error_body(detail, exc.code), **exc.answer_fields()}
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


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
    return JSONResponse(error_body(detail, VALIDATION_CODE), status_code=422)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's ``HTTPException`` (as FastAPI's default handler answers it) plus a code."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code in (204, 304):  # no body allowed
        return Response(status_code=exc.status_code, headers=exc.headers)
    code = HTTP_STATUS_CODES.get(exc.status_code, f"http_{exc.status_code}")
    return JSONResponse(
        error_body(exc.detail, code), status_code=exc.status_code, headers=exc.headers
    )


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """An exception no handler above knows (a bug): 500 with the same body as every other
    error, the details only in the server's log (Starlette logs the traceback as it
    re-raises), never in the answer."""
    return JSONResponse(error_body("internal server error", INTERNAL_CODE), status_code=500)


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
        error_body("Method Not Allowed", HTTP_STATUS_CODES[405]),
        status_code=405,
        headers={"Allow": ", ".join(allowed)},
    )


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers above on ``app``."""
    app.add_exception_handler(DdpqError, _ddpq_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(405, _method_not_allowed)
    app.add_exception_handler(Exception, _unexpected_error)
