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

from service.core.errors import DdpqError
from service.store.models import Job, utcnow

WINDOW_S = 60.0


class RateLimitedError(DdpqError):
    """Too many submissions by one owner in the last minute; ``retry_after_s`` says when the
    next one is accepted (seconds, ≥ 1)."""

    status_code = 429
    code = "rate_limited"

    def __init__(self, owner: str, per_minute: int, retry_after_s: int) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(
            f"owner {owner!r} submitted {per_minute} jobs in the last minute (the limit, "
            f"DDPQ_SUBMISSIONS_PER_MINUTE); retry in {retry_after_s} s"
        )


def _owner_lock_key(owner: str) -> int:
    """A stable signed 64-bit key for ``pg_advisory_xact_lock`` (Python's hash() is salted)."""
    digest = hashlib.sha256(b"ddpq-submit:" + owner.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def check_submission_rate(
    session: Session, owner: str, *, per_minute: int, now: datetime | None = None
) -> None:
    """Allow ``owner`` one more submission unless they stored ``per_minute`` jobs in the
    last 60 s. Call it inside the write transaction that then inserts the job.

    Reads the owner's newest ``per_minute`` jobs on the ``(owner, id)`` index: ids grow with
    ``created_at``, so the limit is reached exactly when the oldest of them is younger than
    the window, and the next submission is allowed when it leaves the window.

    Raises:
        RateLimitedError: over the limit (HTTP 429); nothing was written.
    """
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(func.pg_advisory_xact_lock(_owner_lock_key(owner))))
    newest = (
        select(Job.created_at)
        .where(Job.owner == owner)
        .order_by(Job.id.desc())
        .limit(per_minute)
        .subquery()
    )
    count, oldest = session.execute(
        select(func.count(), func.min(newest.c.created_at)).select_from(newest)
    ).one()
    if count < per_minute or oldest is None:
        return
    # "now" only after the query: on SQLite the query is what waited for the write lock.
    now = now or utcnow()
    wait_s = (oldest + timedelta(seconds=WINDOW_S) - now).total_seconds()
    if wait_s > 0:
        # Clamped: another API host's clock may run ahead of ours.
        raise RateLimitedError(owner, per_minute, min(int(WINDOW_S), max(1, math.ceil(wait_s))))
