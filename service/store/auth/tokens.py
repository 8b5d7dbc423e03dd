"""API tokens: create (the secret shown once, only its sha256 stored), look up, list, revoke.

A user's token is ``ddpq_``, a worker's ``ddpqw_`` (``WORKER_TOKEN_PREFIX``), plus 32 random
bytes from ``secrets.token_urlsafe`` (256 bits). The table keeps ``sha256(token)`` and its
kind, and nothing from which the token could be rebuilt. A user token opens only the user
routes, a worker token only the worker routes (``service.api.deps``).
"""

from __future__ import annotations

import re
import secrets

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.core.errors import DdpqError, NotFoundError
from service.core.tokens import hash_token
from service.core.wire.worker import WORKER_TOKEN_PREFIX
from service.store.auth.values import Caller
from service.store.models import ApiToken, utcnow

TOKEN_PREFIX = "ddpq_"  # lets secret scanners and people recognise a leaked token
USER, WORKER = "user", "worker"  # api_tokens.kind
# A worker token's owner column: workers own no jobs.
WORKER_TOKEN_OWNER = "worker"
TOKEN_BYTES = 32
MAX_TOKEN_CHARS = 200  # longer Authorization values are refused without a database lookup
OWNER_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,99}$")


class InvalidOwnerError(DdpqError):
    """An owner name outside the allowed characters or length."""

    status_code = 422
    code = "invalid_owner"


def new_token(kind: str = USER) -> str:
    """A fresh random token: ``ddpq_`` (a user's) or ``ddpqw_`` (a worker's) + 43 URL-safe
    characters."""
    prefix = WORKER_TOKEN_PREFIX if kind == WORKER else TOKEN_PREFIX
    return prefix + secrets.token_urlsafe(TOKEN_BYTES)


def check_owner(owner: str) -> str:
    """``owner`` if it is a valid owner name (1–100 characters: letters, digits, ``._@+-``,
    starting with a letter or digit).

    Raises:
        InvalidOwnerError: otherwise; the message says what is allowed.
    """
    if not OWNER_PATTERN.fullmatch(owner):
        raise InvalidOwnerError(
            f"invalid owner {owner[:120]!r}: use 1–100 letters, digits or . _ @ + -, "
            "starting with a letter or digit (e.g. alice or team-vision)"
        )
    return owner


def create_token(
    session: Session, *, owner: str, admin: bool = False, kind: str = USER, name: str | None = None
) -> tuple[ApiToken, str]:
    """Store a new token (only its hash): a user token for ``owner``, or (``kind`` "worker")
    a worker token called ``name`` (``owner`` is then ``WORKER_TOKEN_OWNER``).

    Returns:
        ``(row, token)``: the stored row and the token itself, which exists nowhere else
        afterwards; show it once.

    Raises:
        InvalidOwnerError: ``owner`` (or ``name``) is not a valid name.
    """
    if kind == WORKER:
        owner, admin = WORKER_TOKEN_OWNER, False
    if name is not None:
        check_owner(name)
    token = new_token(kind)
    row = ApiToken(
        owner=check_owner(owner), token_hash=hash_token(token), admin=admin, kind=kind, name=name
    )
    session.add(row)
    session.flush()
    return row, token


def find_caller(session: Session, token: str) -> Caller | None:
    """The caller that ``token`` identifies, or None for an unknown, revoked or malformed
    token. One indexed lookup by hash, no cache: a revocation takes effect on the next
    request."""
    if not token or len(token) > MAX_TOKEN_CHARS:
        return None
    row = session.execute(
        select(ApiToken.owner, ApiToken.admin).where(
            ApiToken.token_hash == hash_token(token),
            ApiToken.revoked_at.is_(None),
            ApiToken.kind == USER,
        )
    ).one_or_none()
    return None if row is None else Caller(owner=row.owner, admin=bool(row.admin))


def find_worker_token(session: Session, token: str) -> int | None:
    """The id of the live worker token ``token``; None for an unknown, revoked, malformed or
    user token. One indexed lookup by hash, no cache (a revocation holds from the next
    request)."""
    if not token or len(token) > MAX_TOKEN_CHARS:
        return None
    return session.scalar(
        select(ApiToken.id).where(
            ApiToken.token_hash == hash_token(token),
            ApiToken.revoked_at.is_(None),
            ApiToken.kind == WORKER,
        )
    )


def revoke_worker_tokens_named(session: Session, name: str) -> int:
    """Revoke every live worker token called ``name`` (``ddpq up`` replaces its own token on
    each start); how many were revoked."""
    result = session.execute(
        update(ApiToken)
        .where(ApiToken.kind == WORKER, ApiToken.name == name, ApiToken.revoked_at.is_(None))
        .values(revoked_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount or 0)  # type: ignore[attr-defined]


def list_tokens(session: Session) -> list[ApiToken]:
    """Every token row (hashes only), oldest first, revoked ones included."""
    return list(session.scalars(select(ApiToken).order_by(ApiToken.id)))


def revoke_token(session: Session, token_id: int) -> ApiToken:
    """Revoke token ``token_id`` from now on; revoking it again changes nothing.

    Raises:
        NotFoundError: no token has that id.
    """
    session.execute(
        update(ApiToken)
        .where(ApiToken.id == token_id, ApiToken.revoked_at.is_(None))
        .values(revoked_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    row = session.get(ApiToken, token_id, populate_existing=True)
    if row is None:
        raise NotFoundError(f"no token with id {token_id} (list them with `ddpq token ls`)")
    return row
