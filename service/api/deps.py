"""Request dependencies: the request's context (the app's Database and Settings, and who the
caller is), checked once per request; and the attempt a rank's token stands for.

Two kinds of bearer token, never interchangeable: API tokens (``ddpq_…``) open the user
routes, attempt tokens (``ddpqa_…``, ``service.store.attempts.tokens``) open only the attempt
routes (``/api/v1/attempts/self/…``); each is looked up through its use case
(``service.store.auth.service``, ``service.store.attempts.service``). A user route answers
401 to an attempt token whether auth is on or off, so a rank's token grants nothing else
even on the embedded default."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from service.core.config import Settings
from service.core.tokens import hash_token
from service.core.wire import API_PREFIX
from service.core.wire.attempt import ATTEMPT_PREFIX, ATTEMPT_TOKEN_PREFIX
from service.store.attempts import service as attempts
from service.store.attempts.values import AttemptRef
from service.store.auth import service as auth
from service.store.auth.values import Caller
from service.store.db import Database

# auto_error=False: a missing header is our 401 (with WWW-Authenticate), not FastAPI's
# default answer; the scheme also puts "Authorize" in the OpenAPI docs.
bearer_scheme = HTTPBearer(
    auto_error=False,
    description="An API token from `ddpq token create` (needed when the server's auth is on).",
)

# Documented on every route that needs a token (OpenAPI `responses`).
UNAUTHORIZED: dict[int | str, dict[str, Any]] = {
    401: {"description": "Missing, unknown or revoked API token (auth on), or an attempt token"}
}
# Documented on every attempt route.
ATTEMPT_UNAUTHORIZED: dict[int | str, dict[str, Any]] = {
    401: {"description": "Missing or unknown attempt token (whether auth is on or off)"}
}
ATTEMPT_TOKEN_REFUSED = f"attempt tokens are valid only under {API_PREFIX}{ATTEMPT_PREFIX}"


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


def _unauthorized(detail: str, error: str | None = None) -> HTTPException:
    # RFC 6750 §3: a bearer challenge; error="invalid_token" when one was sent but refused.
    challenge = "Bearer" if error is None else f'Bearer error="{error}"'
    return HTTPException(401, detail, headers={"WWW-Authenticate": challenge})


def _holds_attempt_token(request: Request) -> bool:
    """Whether any Authorization header of ``request`` carries an attempt token (all of
    them: with auth off nobody else looks at a second header)."""
    for value in request.headers.getlist("authorization"):
        scheme, _, param = value.strip().partition(" ")
        if scheme.lower() == "bearer" and param.strip().startswith(ATTEMPT_TOKEN_PREFIX):
            return True
    return False


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
            revoked token, or more than one Authorization header; and for an attempt token
            whether auth is on or off.
        DatabaseUnavailableError: the token could not be looked up (503).
    """
    db: Database = request.app.state.db
    settings: Settings = request.app.state.settings
    if _holds_attempt_token(request):
        # Before the auth switch: a rank's token must open no user route, auth on or off.
        raise _unauthorized(ATTEMPT_TOKEN_REFUSED, "invalid_token")
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
    caller = await run_in_threadpool(auth.find_caller, db, credentials.credentials)
    if caller is None:
        raise _unauthorized("invalid or revoked API token", "invalid_token")
    return RequestContext(db, settings, caller)


# Known attempt tokens of this process, by hash: a token's (job, attempt) never changes and
# no row is revoked (the fence, checked by every route on its own statement, is what shuts a
# superseded attempt out; a deleted job fails the fence too), so a hit needs no lookup. That
# saves a round trip and a thread hop per metric batch. Unknown tokens are never cached.
MAX_CACHED_ATTEMPTS = 10_000


def _attempt_cache(request: Request) -> dict[str, AttemptRef]:
    cache: dict[str, AttemptRef] | None = getattr(request.app.state, "attempt_refs", None)
    if cache is None:
        cache = request.app.state.attempt_refs = {}
    return cache


async def get_attempt(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> AttemptRef:
    """The attempt whose token the request carries (``Authorization: Bearer ddpqa_…``): the
    only way into the attempt routes, whether auth is on or off. It says which attempt the
    caller speaks for, not that the attempt is still current: every route fences that on its
    own statement (409 ``attempt superseded`` from there). A token found once is remembered
    by this process (``_attempt_cache``); an unknown one is looked up every time.

    Raises:
        HTTPException: 401 with ``WWW-Authenticate: Bearer`` for a missing token, one that is
            not an attempt token (an API token included), an unknown one, or more than one
            Authorization header.
        DatabaseUnavailableError: the token could not be looked up (503).
    """
    if len(request.headers.getlist("authorization")) > 1:
        raise _unauthorized("send exactly one Authorization header", "invalid_request")
    if credentials is None:
        raise _unauthorized(
            "missing attempt token: send `Authorization: Bearer <DDPQ_ATTEMPT_TOKEN>` (the "
            "worker hands one to the ranks of each attempt)"
        )
    token = credentials.credentials
    if not token.startswith(ATTEMPT_TOKEN_PREFIX):
        raise _unauthorized(
            "not an attempt token: these routes are for a job's ranks only", "invalid_token"
        )
    cache = _attempt_cache(request)
    key = hash_token(token)
    ref = cache.get(key)
    if ref is not None:
        return ref
    db: Database = request.app.state.db
    ref = await asyncio.get_running_loop().run_in_executor(None, attempts.find_attempt, db, token)
    if ref is None:
        raise _unauthorized("unknown attempt token", "invalid_token")
    if len(cache) >= MAX_CACHED_ATTEMPTS:
        cache.clear()  # rare (that many live attempts per process): start over, stay bounded
    cache[key] = ref
    return ref


DbDep = Annotated[Database, Depends(get_db)]
SettingsDep = Annotated[Settings, Depends(get_app_settings)]
ContextDep = Annotated[RequestContext, Depends(get_context)]
# On every router that needs a caller, so no route of it can run without one; its routes take
# ``ctx: ContextDep`` (the same call: FastAPI's per-request cache runs it once).
REQUIRE_CALLER = Depends(get_context)
# Likewise for the attempt routes.
AttemptDep = Annotated[AttemptRef, Depends(get_attempt)]
REQUIRE_ATTEMPT = Depends(get_attempt)
