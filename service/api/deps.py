"""Request dependencies: the request's context (the app's Database and Settings, and who the
caller is), checked once per request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from service.core.config import Settings
from service.store.db import Database
from service.store.tokens import Caller, find_caller

# auto_error=False: a missing header is our 401 (with WWW-Authenticate), not FastAPI's
# default answer; the scheme also puts "Authorize" in the OpenAPI docs.
bearer_scheme = HTTPBearer(
    auto_error=False,
    description="An API token from `ddpq token create` (needed when the server's auth is on).",
)

# Documented on every route that needs a token (OpenAPI `responses`).
UNAUTHORIZED: dict[int | str, dict[str, Any]] = {
    401: {"description": "Missing, unknown or revoked API token (auth on)"}
}


# The dependencies are ``async def`` although they do no I/O there: FastAPI runs a plain
# ``def`` dependency in the threadpool, and those hops (one per dependency per request) cost
# more CPU than the whole GET /jobs/{id} query did.
async def get_db(request: Request) -> Database:
    """The Database that ``create_app`` built for this app."""
    db: Database = request.app.state.db
    return db


async def get_app_settings(request: Request) -> Settings:
    """The Settings that ``create_app`` was given."""
    settings: Settings = request.app.state.settings
    return settings


def _find_caller(db: Database, token: str) -> Caller | None:
    with db.session(write=False) as session:
        return find_caller(session, token)


def _unauthorized(detail: str, error: str | None = None) -> HTTPException:
    # RFC 6750 §3: a bearer challenge; error="invalid_token" when one was sent but refused.
    challenge = "Bearer" if error is None else f'Bearer error="{error}"'
    return HTTPException(401, detail, headers={"WWW-Authenticate": challenge})


@dataclass(frozen=True)
class RequestContext:
    """What a route needs besides its own parameters: the app's Database and Settings and
    who is calling. One dependency instead of four: FastAPI 0.165 re-solves every node of a
    route's dependency tree on every request (12 nodes were ~15% of a GET's CPU)."""

    db: Database
    settings: Settings
    caller: Caller

    @property
    def owner(self) -> str | None:
        """The owner whose jobs the caller may read and change; None means every job (an
        admin, or anyone when auth is off). Someone else's job is then "not found" (404),
        not 403, so its existence does not leak."""
        return self.caller.owner_filter


async def get_context(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> RequestContext:
    """The request's context; the one place where API tokens are checked.

    With auth off (``settings.auth_enabled`` False) everyone is ``settings.default_owner``
    and sees every job. With auth on, the ``Authorization: Bearer <token>`` header must hold
    a live token; it is looked up on every request (one indexed query, no cache), so a
    revoked token stops working at once.

    Raises:
        HTTPException: 401 with ``WWW-Authenticate: Bearer`` for a missing, unknown or
            revoked token, or more than one Authorization header.
        DatabaseUnavailableError: the token could not be looked up (503).
    """
    db: Database = request.app.state.db
    settings: Settings = request.app.state.settings
    if not settings.auth_enabled:
        return RequestContext(db, settings, Caller(owner=settings.default_owner, admin=True))
    if len(request.headers.getlist("authorization")) > 1:
        # A proxy that reads another of them would disagree with us on who is calling.
        raise _unauthorized("send exactly one Authorization header", "invalid_request")
    if credentials is None:
        raise _unauthorized(
            "missing API token: send `Authorization: Bearer <token>` (set DDPQ_TOKEN for the "
            "CLI; an operator creates one with `ddpq token create --owner NAME`)"
        )
    caller = await run_in_threadpool(_find_caller, db, credentials.credentials)
    if caller is None:
        raise _unauthorized("invalid or revoked API token", "invalid_token")
    return RequestContext(db, settings, caller)


DbDep = Annotated[Database, Depends(get_db)]
SettingsDep = Annotated[Settings, Depends(get_app_settings)]
ContextDep = Annotated[RequestContext, Depends(get_context)]
# On every router that needs a caller, so no route of it can run without one; its routes take
# ``ctx: ContextDep`` (the same call: FastAPI's per-request cache runs it once).
REQUIRE_CALLER = Depends(get_context)
