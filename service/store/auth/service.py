"""The auth resource's use cases, each opening its own session: who an API token stands for
(looked up on every request), and the operator's token commands (create, list, revoke). An
attempt token is the attempts resource's (``service.store.attempts.service.find_attempt``)."""

from __future__ import annotations

from service.store.auth import tokens
from service.store.auth.values import Caller, CreatedToken, TokenInfo
from service.store.db import Database
from service.store.models import ApiToken


def find_caller(db: Database, token: str) -> Caller | None:
    """The caller an API token identifies; None for an unknown, revoked or malformed one
    (one indexed lookup by hash, no cache: a revocation takes effect on the next request).

    Raises:
        DatabaseUnavailableError: the token could not be looked up (503).
    """
    with db.session(write=False) as session:
        return tokens.find_caller(session, token)


def find_worker_token(db: Database, token: str) -> int | None:
    """The id of the live worker token ``token``; None for an unknown, revoked, malformed or
    user token (one indexed lookup, no cache).

    Raises:
        DatabaseUnavailableError: the token could not be looked up (503).
    """
    with db.session(write=False) as session:
        return tokens.find_worker_token(session, token)


def create_token(db: Database, *, owner: str, admin: bool = False) -> CreatedToken:
    """Store a new API token for ``owner`` (only its hash); the token itself is returned once.

    Raises:
        InvalidOwnerError: ``owner`` is not a valid owner name (422).
    """
    with db.session() as session:
        row, token = tokens.create_token(session, owner=owner, admin=admin)
        return CreatedToken(_info(row), token)


def create_worker_token(
    db: Database, *, name: str | None = None, replace: bool = False
) -> CreatedToken:
    """Store a new worker token called ``name`` (only its hash); the token itself is returned
    once. ``replace``: revoke the live worker tokens of that name first, in the same
    transaction (``ddpq up`` mints its own on every start).

    Raises:
        InvalidOwnerError: ``name`` is not a valid name (422).
    """
    with db.session() as session:
        if replace and name is not None:
            tokens.revoke_worker_tokens_named(session, name)
        row, token = tokens.create_token(
            session, owner=tokens.WORKER_TOKEN_OWNER, kind=tokens.WORKER, name=name
        )
        return CreatedToken(_info(row), token)


def list_tokens(db: Database) -> list[TokenInfo]:
    """Every API token (hashes only, so no secret), oldest first, revoked ones included."""
    with db.session(write=False) as session:
        return [_info(row) for row in tokens.list_tokens(session)]


def revoke_token(db: Database, token_id: int) -> TokenInfo:
    """Revoke token ``token_id`` from the next request on; revoking it again changes nothing.

    Raises:
        NotFoundError: no token has that id.
    """
    with db.session() as session:
        return _info(tokens.revoke_token(session, token_id))


def _info(row: ApiToken) -> TokenInfo:
    return TokenInfo(
        row.id, row.owner, bool(row.admin), row.created_at, row.revoked_at, row.kind, row.name
    )
