"""Request dependencies: the request's context (the app's Database and Settings, and who the
caller is), checked once per request; and the attempt a rank's token stands for.

Three kinds of bearer token, never interchangeable: users' API tokens (``ddpq_…``) open the
user routes, attempt tokens (``ddpqa_…``, ``service.store.attempts.tokens``) open only the
attempt routes (``/api/v1/attempts/self/…``), worker tokens (``ddpqw_…``) open only the worker
routes (``/api/v1/workers/self/…``); each is looked up through its use case
(``service.store.auth.service``, ``service.store.attempts.service``,
``service.store.workers.service``). A user route answers 401 to an attempt or worker token
whether auth is on or off, so a rank's or a worker's token grants nothing else even on the
embedded default; the attempt and worker routes demand their own token even with auth off."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from service.core.config import Settings
from service.core.tokens import hash_token
from service.core.wire import API_PREFIX
from service.core.wire.attempt import ATTEMPT_PREFIX, ATTEMPT_TOKEN_PREFIX
from service.core.wire.worker import (
    REVOKED_TOKEN_GRACE_S,
    WORKER_ID_HEADER,
    WORKER_PREFIX,
    WORKER_TOKEN_PREFIX,
)
from service.store.attempts import service as attempts
from service.store.attempts.values import AttemptRef
from service.store.auth import service as auth
from service.store.auth.values import Caller
from service.store.db import Database
from service.store.workers import service as workers
from service.store.workers.values import WorkerCaller

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
WORKER_TOKEN_REFUSED = f"worker tokens are valid only under {API_PREFIX}{WORKER_PREFIX}"
# Documented on every worker route.
WORKER_UNAUTHORIZED: dict[int | str, dict[str, Any]] = {
    401: {"description": "Missing, unknown or revoked worker token (whether auth is on or off)"},
    403: {"description": "The worker id is registered with another worker token"},
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


def _unauthorized(detail: str, error: str | None = None) -> HTTPException:
    # RFC 6750 §3: a bearer challenge; error="invalid_token" when one was sent but refused.
    challenge = "Bearer" if error is None else f'Bearer error="{error}"'
    return HTTPException(401, detail, headers={"WWW-Authenticate": challenge})


def _service_token_refusal(request: Request) -> str | None:
    """Why a user route refuses ``request``: any of its Authorization headers carries an
    attempt or a worker token (all of them: with auth off nobody else looks at a second
    header). None when none does."""
    for value in request.headers.getlist("authorization"):
        scheme, _, param = value.strip().partition(" ")
        if scheme.lower() != "bearer":
            continue
        if param.strip().startswith(ATTEMPT_TOKEN_PREFIX):
            return ATTEMPT_TOKEN_REFUSED
        if param.strip().startswith(WORKER_TOKEN_PREFIX):
            return WORKER_TOKEN_REFUSED
    return None


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
            revoked token, or more than one Authorization header; and for an attempt or a
            worker token whether auth is on or off.
        DatabaseUnavailableError: the token could not be looked up (503).
    """
    db: Database = request.app.state.db
    settings: Settings = request.app.state.settings
    refusal = _service_token_refusal(request)
    if refusal is not None:
        # Before the auth switch: a rank's or a worker's token opens no user route, auth on
        # or off.
        raise _unauthorized(refusal, "invalid_token")
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
    """The dependency form of ``attempt_of``."""
    return await _attempt_for(request, credentials)


async def attempt_of(request: Request) -> AttemptRef:
    """``get_attempt`` called by a route itself rather than as a dependency, for the metric
    ingest, whose per-request dependency solving cost as much CPU as its write. The route
    documents its ``security`` itself (``ATTEMPT_SECURITY``).

    Raises: as ``_attempt_for``.
    """
    return await _attempt_for(request, await bearer_scheme(request))


async def _attempt_for(
    request: Request, credentials: HTTPAuthorizationCredentials | None
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


async def get_worker(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> WorkerCaller:
    """The worker calling (``Authorization: Bearer ddpqw_…`` and the ``Ddpq-Worker-Id``
    header): the only way into the worker routes, whether auth is on or off. The token is
    looked up with the worker's row (one indexed statement) and, once the id is registered
    with it, remembered for ``REVOKED_TOKEN_GRACE_S`` seconds (``_worker_cache``): a revoked
    token's worker is refused from its next claim or heartbeat (they check the token in
    their own transaction) and from any call after that grace. Whether the id is registered
    (and by this token) is the route's to check: registration is how a worker gets a row.

    Raises:
        HTTPException: 401 with ``WWW-Authenticate: Bearer`` for a missing token, one that is
            not a worker token (a user's or an attempt's), an unknown or revoked one, or more
            than one Authorization header; 422 for a missing or malformed worker id header.
        DatabaseUnavailableError: the token could not be looked up (503).
    """
    if len(request.headers.getlist("authorization")) > 1:
        raise _unauthorized("send exactly one Authorization header", "invalid_request")
    if credentials is None:
        raise _unauthorized(
            "missing worker token: send `Authorization: Bearer <DDPQ_WORKER_TOKEN>` (an "
            "operator creates one with `ddpq token create --worker`)"
        )
    token = credentials.credentials
    if not token.startswith(WORKER_TOKEN_PREFIX):
        raise _unauthorized(
            "not a worker token: these routes are for workers only (`ddpq token create --worker`)",
            "invalid_token",
        )
    worker_id = request.headers.get(WORKER_ID_HEADER, "")
    if not WORKER_ID_RE.fullmatch(worker_id):
        raise HTTPException(
            422, f"send the {WORKER_ID_HEADER} header: 1–128 letters, digits or ._:@+-"
        )
    cache = _worker_cache(request)
    key = request.state.worker_cache_key = (hash_token(token), worker_id)
    now = time.monotonic()
    hit = cache.get(key)
    if hit is not None and hit[0] > now:
        return hit[1]
    db: Database = request.app.state.db
    caller = await run_in_threadpool(workers.find_worker_caller, db, token, worker_id)
    if caller is None:
        raise _unauthorized("unknown or revoked worker token", "invalid_token")
    if caller.owns_row:  # a caller still to register (or refused) is looked up each time
        if len(cache) >= MAX_CACHED_WORKERS:
            cache.clear()  # rare (that many workers per process): start over, stay bounded
        cache[key] = (now + REVOKED_TOKEN_GRACE_S, caller)
    return caller


def forget_worker(request: Request) -> None:
    """Drop what this process remembers of the request's worker caller (``get_worker``): its
    registration just changed."""
    key: tuple[str, str] | None = getattr(request.state, "worker_cache_key", None)
    if key is not None:
        _worker_cache(request).pop(key, None)


# Worker callers this process verified, by (token hash, worker id), until the time (monotonic
# seconds) they must be looked up again: every request of every worker would otherwise start
# with a database round trip and a threadpool hop. Only callers that registered their id with
# their token are kept. A revocation still stops a claim and a heartbeat at once (each checks
# the token in its own transaction), every other route within REVOKED_TOKEN_GRACE_S.
MAX_CACHED_WORKERS = 10_000


def _worker_cache(request: Request) -> dict[tuple[str, str], tuple[float, WorkerCaller]]:
    cache: dict[tuple[str, str], tuple[float, WorkerCaller]] | None = getattr(
        request.app.state, "worker_callers", None
    )
    if cache is None:
        cache = request.app.state.worker_callers = {}
    return cache


WORKER_ID_RE = re.compile(r"[A-Za-z0-9._:@+-]{1,128}")

DbDep = Annotated[Database, Depends(get_db)]
SettingsDep = Annotated[Settings, Depends(get_app_settings)]
ContextDep = Annotated[RequestContext, Depends(get_context)]
# On every router that needs a caller, so no route of it can run without one; its routes take
# ``ctx: ContextDep`` (the same call: FastAPI's per-request cache runs it once).
REQUIRE_CALLER = Depends(get_context)
# Likewise for the attempt routes.
AttemptDep = Annotated[AttemptRef, Depends(get_attempt)]
# The OpenAPI ``security`` of a route that calls ``attempt_of`` itself: what ``AttemptDep``
# gives the others (the scheme is ``bearer_scheme``'s).
ATTEMPT_SECURITY: list[dict[str, list[str]]] = [{"HTTPBearer": []}]
REQUIRE_ATTEMPT = Depends(get_attempt)
# Likewise for the worker routes.
WorkerDep = Annotated[WorkerCaller, Depends(get_worker)]
REQUIRE_WORKER = Depends(get_worker)
