"""Attempt tokens: the bearer secret a worker hands the ranks of one (job, attempt).

A token is ``ATTEMPT_TOKEN_PREFIX`` plus 32 random bytes from ``secrets.token_urlsafe`` (256
bits); the table keeps only its sha256 (``tokens.hash_token``, the API tokens' hash). The
token says *which* attempt a caller speaks for; the fence (``leases.fence_attempt`` /
``lock_attempt``) says whether that attempt may still act, on every call. So nothing is ever
revoked here: a requeue, a cancel or a terminal state makes the attempt's tokens useless at
once, and the rows go with their job (ON DELETE CASCADE).
"""

from __future__ import annotations

import secrets
from typing import Any

from sqlalchemy import Row, Table, insert, select
from sqlalchemy.orm import Session

from service.core.states import JobState
from service.core.wire.attempt import ATTEMPT_TOKEN_PREFIX
from service.store.attempts.values import AttemptRef as AttemptRef  # re-exported for callers
from service.store.auth.tokens import MAX_TOKEN_CHARS, TOKEN_BYTES, hash_token
from service.store.models import AttemptToken, Job
from service.store.workers.leases import fence_attempt


def new_attempt_token() -> str:
    """A fresh random attempt token (``ddpqa_`` + 43 URL-safe characters)."""
    return ATTEMPT_TOKEN_PREFIX + secrets.token_urlsafe(TOKEN_BYTES)


def mint_attempt_token(session: Session, job_id: int, attempt: int) -> str:
    """Store a new token for ``attempt`` of job ``job_id`` (only its hash) and return it.

    The worker calls it when it launches the attempt and hands the token to the ranks; it
    exists nowhere else afterwards. Minting again for the same attempt (a relaunch of the
    same attempt, a second launcher process) adds another valid token: each works on its own.

    Raises:
        ConflictError: no job ``job_id`` (the foreign key; 409 through the session scope).
    """
    token = new_attempt_token()
    # A Core INSERT on the table, not session.add + flush (nor the ORM's bulk INSERT): it
    # runs in every claim's transaction.
    row = {"job_id": job_id, "attempt": attempt, "token_hash": hash_token(token)}
    table: Table = AttemptToken.__table__  # type: ignore[assignment]
    session.execute(insert(table).values(**row))
    return token


def find_attempt(session: Session, token: str) -> AttemptRef | None:
    """The attempt ``token`` was minted for, or None for an unknown, malformed or non-attempt
    token (an API token included). One indexed lookup by hash: no secret bytes are compared
    in Python, so the answer's timing says nothing about the token."""
    if not token.startswith(ATTEMPT_TOKEN_PREFIX) or len(token) > MAX_TOKEN_CHARS:
        return None
    row = session.execute(
        select(AttemptToken.job_id, AttemptToken.attempt).where(
            AttemptToken.token_hash == hash_token(token)
        )
    ).one_or_none()
    return None if row is None else AttemptRef(job_id=int(row.job_id), attempt=int(row.attempt))


def current_state(session: Session, ref: AttemptRef) -> JobState:
    """The job's state, after the fence: ``ref`` must be its current, active attempt. A plain
    read (no row lock), for the attempt routes that write nothing.

    Raises:
        NotFoundError: the job is gone.
        StaleAttemptError: the attempt is not current, or the job is not starting/running.
    """
    stmt = select(Job.attempt, Job.state).where(Job.id == ref.job_id)
    found: Row[Any] | None = session.execute(stmt).one_or_none()  # type: ignore[assignment]
    return JobState(fence_attempt(ref.job_id, ref.attempt, found).state)
