"""The claim: how a worker takes the next queued job (procrastinate's one-statement
``FOR UPDATE SKIP LOCKED`` claim), and the cheap read that tells an idle worker whether a claim
is worth trying.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any

from sqlalchemy import String, bindparam, exists, insert, select, update
from sqlalchemy.orm import Session, aliased

from service.core.states import JobState
from service.store.models import Job, JobEvent, UTCDateTime, utcnow


def has_claimable_job(session: Session, *, launcher: str, max_gpus_per_node: int) -> bool:
    """True when a queued job exists that ``claim_next_job`` with the same arguments could
    take. One read on the claim index (no write lock, unlike the claim on SQLite): idle workers
    poll it often to start new jobs quickly, and claim only when it says yes."""
    return bool(session.scalar(select(exists().where(*_claimable(launcher, max_gpus_per_node)))))


def _claimable(launcher: Any, max_gpus: Any) -> tuple[Any, ...]:
    """The WHERE clause of a claimable job (one fact, used by the claim and the poll)."""
    return (
        Job.state == JobState.QUEUED.value,
        Job.cancel_requested.is_(False),
        Job.launcher == launcher,
        Job.gpus_per_node <= max_gpus,
    )


def claim_next_job(
    session: Session,
    *,
    worker_id: str,
    launcher: str,
    max_gpus_per_node: int,
    lease_s: float,
) -> Job | None:
    """Claim the best queued job that fits: highest priority, then oldest.

    ``UPDATE jobs … WHERE id = (SELECT id … FOR UPDATE SKIP LOCKED LIMIT 1) AND state =
    'queued' RETURNING …`` plus its ``job_events`` row: one statement on PostgreSQL (a CTE),
    two on SQLite. On PostgreSQL concurrent claimers skip each other's locked rows; on SQLite
    the session's ``BEGIN IMMEDIATE`` serialises claimers and the ``state = 'queued'`` test
    is the compare-and-set.

    A queued job with ``cancel_requested`` is never claimed (and the flag never dropped);
    the reaper cancels it (``cancel_flagged_queued_jobs``), off this hot path.

    Returns:
        The job, now ``starting`` and leased to ``worker_id`` until now + ``lease_s``
        seconds; None when nothing fits.
    """
    now = utcnow()
    # "claim_" names: SQLAlchemy turns an execute() parameter named like a column of the
    # UPDATE's table (e.g. "launcher") into an extra SET clause.
    params = {
        "claim_launcher": launcher,
        "claim_max_gpus": max_gpus_per_node,
        "claim_worker_id": worker_id,
        "claim_lease_until": now + timedelta(seconds=lease_s),
        "claim_now": now,
    }
    load = {"populate_existing": True}
    if session.get_bind().dialect.name == "postgresql":
        stmt = _claim_statements()[1]
        return session.scalars(stmt, params, execution_options=load).one_or_none()
    job = session.scalars(
        _claim_statements()[0],
        params,
        execution_options={**load, "synchronize_session": False},
    ).one_or_none()
    if job is not None:
        session.execute(
            _CLAIM_EVENT, {"claim_job_id": job.id, "claim_attempt": job.attempt, **params}
        )
    return job


_CLAIM_EVENT_VALUES = {
    "from_state": bindparam("claim_from_state", JobState.QUEUED.value, type_=String()),
    "to_state": bindparam("claim_to_state", JobState.STARTING.value, type_=String()),
    "reason": bindparam("claim_reason", "claimed", type_=String()),
    "worker_id": bindparam("claim_worker_id", type_=String()),
    "created_at": bindparam("claim_now", type_=UTCDateTime()),
}
_CLAIM_EVENT = insert(JobEvent).values(
    job_id=bindparam("claim_job_id"), attempt=bindparam("claim_attempt"), **_CLAIM_EVENT_VALUES
)


@functools.cache
def _claim_statements() -> tuple[Any, Any]:
    """The claim, built once with bound parameters (building it per call cost more Python time
    than the database spent running it): ``(UPDATE … RETURNING the job, the same UPDATE plus
    its event INSERT as one PostgreSQL statement of data-modifying CTEs)``."""
    candidate = (
        select(Job.id)
        .where(*_claimable(bindparam("claim_launcher"), bindparam("claim_max_gpus")))
        .order_by(Job.priority.desc(), Job.id)
        .limit(1)
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    claim = (
        update(Job)
        .where(
            Job.id == candidate,
            Job.state == JobState.QUEUED.value,
            Job.cancel_requested.is_(False),
        )
        .values(
            state=JobState.STARTING.value,
            worker_id=bindparam("claim_worker_id"),
            lease_expires_at=bindparam("claim_lease_until", type_=UTCDateTime()),
            updated_at=bindparam("claim_now", type_=UTCDateTime()),
        )
    )
    claimed = claim.returning(*Job.__table__.c).cte("claimed")
    add_event = (
        insert(JobEvent)
        .from_select(
            ["job_id", "attempt", *_CLAIM_EVENT_VALUES],
            select(claimed.c.id, claimed.c.attempt, *_CLAIM_EVENT_VALUES.values()),
        )
        .cte("claim_event")
    )
    return claim.returning(Job), select(aliased(Job, claimed)).add_cte(add_event)
