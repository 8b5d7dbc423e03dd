"""Per-owner submission rate limit: a sliding 60 s window counted from the jobs table.

Counting stored jobs (not an in-memory bucket) makes the limit hold across API processes
and restarts with no extra store or dependency. The check runs in the submitting
transaction, serialised per owner (SQLite: the write lock taken at BEGIN IMMEDIATE;
PostgreSQL: a transaction-scoped advisory lock on the owner), so concurrent submissions
cannot overshoot it.
"""

from __future__ import annotations

import hashlib
import math
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.core.errors import DdpqError, SpecValidationError
from service.store.models import Job, utcnow

WINDOW_S = 60.0


class RateLimitedError(DdpqError):
    """Too many submissions by one owner in the last minute; ``retry_after_s`` says when the
    next one is accepted (seconds, ≥ 1)."""

    status_code = 429
    code = "rate_limited"

    def __init__(self, owner: str, per_minute: int, retry_after_s: int, jobs: int = 1) -> None:
        self.retry_after_s = retry_after_s
        if jobs == 1:
            did = f"submitted {per_minute} jobs in the last minute"
        else:
            did = f"has no room for {jobs} more jobs in the last minute's {per_minute}"
        super().__init__(
            f"owner {owner!r} {did} (the limit, DDPQ_SUBMISSIONS_PER_MINUTE); "
            f"retry in {retry_after_s} s"
        )


def _owner_lock_key(owner: str) -> int:
    """A stable signed 64-bit key for ``pg_advisory_xact_lock`` (Python's hash() is salted)."""
    digest = hashlib.sha256(b"ddpq-submit:" + owner.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def check_submission_rate(
    session: Session,
    owner: str,
    *,
    per_minute: int,
    now: datetime | None = None,
    jobs: int = 1,
) -> None:
    """Allow ``owner`` ``jobs`` more jobs (a sweep's or an extend's trials, a retry's new
    jobs; 1 for ``POST /jobs``) unless that would make more than ``per_minute`` jobs stored
    in the last 60 s. Call it inside the write transaction that then inserts them.

    Reads the owner's newest ``per_minute - jobs + 1`` jobs on the ``(owner, id)`` index: ids
    grow with ``created_at``, so there is no room exactly when the oldest of them is younger
    than the window, and there is when it leaves the window.

    Raises:
        RateLimitedError: over the limit (HTTP 429, ``retry_after_s``); nothing was written.
        SpecValidationError: ``jobs`` > ``per_minute``, so it never fits (HTTP 422).
    """
    if jobs > per_minute:
        raise SpecValidationError(
            [
                {
                    "loc": ["body"],
                    "msg": f"this makes {jobs} jobs, more than the {per_minute} an owner may "
                    "submit in any minute (DDPQ_SUBMISSIONS_PER_MINUTE): submit fewer trials "
                    "and extend the sweep a minute later, or ask the operator to raise it",
                    "type": "over_rate_limit",
                }
            ]
        )
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(func.pg_advisory_xact_lock(_owner_lock_key(owner))))
    room = per_minute - jobs + 1
    newest = (
        select(Job.created_at)
        .where(Job.owner == owner)
        .order_by(Job.id.desc())
        .limit(room)
        .subquery()
    )
    count, oldest = session.execute(
        select(func.count(), func.min(newest.c.created_at)).select_from(newest)
    ).one()
    if count < room or oldest is None:
        return
    # "now" only after the query: on SQLite the query is what waited for the write lock.
    now = now or utcnow()
    wait_s = (oldest + timedelta(seconds=WINDOW_S) - now).total_seconds()
    if wait_s > 0:
        # Clamped: another API host's clock may run ahead of ours.
        retry_s = min(int(WINDOW_S), max(1, math.ceil(wait_s)))
        raise RateLimitedError(owner, per_minute, retry_s, jobs)


def check_jobs_rate(session: Session, owner: str, *, per_minute: int | None, jobs: int) -> None:
    """``check_submission_rate`` for ``jobs`` new jobs (a sweep's trials); nothing to check
    when ``per_minute`` is None (auth off) or ``jobs`` is 0.

    Raises:
        RateLimitedError: they do not fit the last minute (HTTP 429).
        SpecValidationError: ``jobs`` > ``per_minute`` (HTTP 422).
    """
    if per_minute is not None and jobs > 0:
        check_submission_rate(session, owner, per_minute=per_minute, jobs=jobs)
