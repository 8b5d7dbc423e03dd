"""The claim: how a worker takes the next queued job (procrastinate's one-statement
``FOR UPDATE SKIP LOCKED`` claim), and the cheap read that tells an idle worker whether a claim
is worth trying.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any

from sqlalchemy import bindparam, delete, func, or_, select, text, update
from sqlalchemy.orm import Session

from service.core.events import EventKind
from service.core.holds import ClaimedJob
from service.core.states import JobState, SweepState
from service.store import events
from service.store.models import Job, JobEvent, Sweep, UTCDateTime, utcnow

# The states that hold one of a sweep's max_concurrent places.
HOLDING_STATES = (JobState.STARTING.value, JobState.RUNNING.value)
# Advisory-lock class of the per-sweep claim lock (PostgreSQL; any constant of our own).
SWEEP_CLAIM_LOCK_CLASS = 0x5357


def count_claimable_jobs(
    session: Session, *, launcher: str, max_gpus_per_node: int, limit: int
) -> int:
    """How many queued jobs ``claim_next_job`` with the same arguments could take, counting
    at most ``limit`` (≥ 1): one read on the claim index that stops at ``limit`` rows. The
    long poll's probe wakes that many waiting claims, not all of them."""
    found = select(Job.id).where(*_claimable(launcher, max_gpus_per_node)).limit(limit)
    return int(session.scalar(select(func.count()).select_from(found.subquery())) or 0)


def _claimable(launcher: Any, max_gpus: Any) -> tuple[Any, ...]:
    """The WHERE clause of a claimable job (one fact, used by the claim and the poll).

    A sweep's trial is claimable only while its sweep has fewer than ``max_concurrent``
    trials starting or running (``_FULL_SWEEPS``).
    """
    return (
        Job.state == JobState.QUEUED.value,
        Job.cancel_requested.is_(False),
        Job.launcher == launcher,
        Job.gpus_per_node <= max_gpus,
        or_(Job.sweep_id.is_(None), Job.sweep_id.not_in(_FULL_SWEEPS)),
    )


# Ids of the running sweeps whose ``max_concurrent`` places are all taken. Not correlated
# with the candidate job: the database computes it once per statement (one
# ``ix_jobs_sweep_id_state`` probe per running sweep with a limit), however many queued trials
# the claim passes over (a per-candidate count made each claim behind 1,000 queued trials of
# a full sweep take 6–9 ms). Written as SQL text because SQLAlchemy walks a statement's whole
# tree for its cache key on every execution: built from constructs, this subquery cost ~50 µs
# of Python per claim of every job, a text clause ~nothing. The states are spliced in from
# SweepState and HOLDING_STATES once, at import: constants, never input.
_HOLDING_SQL = " OR ".join(f"holder.state = '{s}'" for s in HOLDING_STATES)
_FULL_SWEEPS = text(
    f"SELECT s.id FROM sweeps AS s WHERE s.state = '{SweepState.RUNNING.value}' "
    "AND s.max_concurrent IS NOT NULL "
    "AND s.max_concurrent <= (SELECT count(*) FROM jobs AS holder WHERE holder.sweep_id = s.id "
    f"AND ({_HOLDING_SQL}))"
).columns(Sweep.id)


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
        claimed = session.scalars(stmt, params, execution_options=load).one_or_none()
        if claimed is not None and claimed.sweep_id is not None:
            return _within_sweep_limit(session, claimed)
        return claimed
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


def lock_sweep_claims(session: Session, sweep_id: int) -> None:
    """Serialise the claims of one sweep until this transaction ends: PostgreSQL's
    transaction-scoped advisory lock ``(SWEEP_CLAIM_LOCK_CLASS, sweep_id % 2**31)``; nothing
    on SQLite, whose ``BEGIN IMMEDIATE`` serialises every writer already. Take it before
    counting ``holding_count`` in a statement of its own, so the count sees every claim of the
    sweep committed before."""
    if session.get_bind().dialect.name != "postgresql":
        return
    session.execute(
        text("SELECT pg_advisory_xact_lock(:lock_class, CAST(:lock_key AS integer))"),
        {"lock_class": SWEEP_CLAIM_LOCK_CLASS, "lock_key": sweep_id % 2**31},
    )


def holding_count(session: Session, sweep_id: int) -> int:
    """How many of the sweep's trials are starting or running (holding a place)."""
    return (
        session.scalar(
            select(func.count()).where(Job.sweep_id == sweep_id, Job.state.in_(HOLDING_STATES))
        )
        or 0
    )


def _within_sweep_limit(session: Session, job: Job) -> Job | None:
    """PostgreSQL only: ``job`` if its sweep still has room counting every committed claim,
    else the claim undone (None).

    The claim's own count reads its statement's snapshot, so two claimers racing for two
    trials of one sweep could each see the last free place. Claims of one sweep are
    serialised here by a transaction-scoped advisory lock: whoever takes it after another
    claim of the sweep committed sees that claim in a fresh count. The undo is inside the
    same uncommitted transaction (the job row is still locked by it), so nobody ever saw
    the job ``starting``; no state changed as far as any other reader can tell.
    """
    assert job.sweep_id is not None
    if not over_sweep_limit(session, job.sweep_id):
        return job
    unclaim(session, job)
    return None


def over_sweep_limit(session: Session, sweep_id: int) -> int:
    """How many of the sweep's trials starting or running exceed its ``max_concurrent``
    (0: within it, or no limit), counted after taking the sweep's claim lock
    (``lock_sweep_claims``), so every claim of the sweep committed before is counted."""
    lock_sweep_claims(session, sweep_id)
    limit = session.scalar(select(Sweep.max_concurrent).where(Sweep.id == sweep_id))
    if limit is None:
        return 0
    return max(0, holding_count(session, sweep_id) - int(limit))


def unclaim(session: Session, job: Job) -> None:
    """Undo this transaction's claim of ``job``: queued again, unheld, its ``claimed`` event
    deleted. Only for a claim not yet committed (its row is still locked by it), so nobody
    ever saw the job ``starting``."""
    session.execute(
        update(Job)
        .where(Job.id == job.id, Job.state == JobState.STARTING.value)
        .values(state=JobState.QUEUED.value, worker_id=None, lease_expires_at=None)
        .execution_options(synchronize_session=False)
    )
    session.execute(
        delete(JobEvent).where(
            JobEvent.job_id == job.id,
            JobEvent.attempt == job.attempt,
            JobEvent.kind == EventKind.CLAIMED.value,
            JobEvent.id == select(func.max(JobEvent.id)).where(JobEvent.job_id == job.id)
            .scalar_subquery(),
        )
    )  # fmt: skip
    session.expire(job)


_CLAIM_EVENT = events.CLAIM_EVENT


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
    return claim_update_statements(Job.id == candidate)


def claim_update_statements(picked: Any, *ctes: Any) -> tuple[Any, Any]:
    """The claim's writes for the queued jobs ``picked`` (a WHERE clause on ``jobs``, e.g.
    ``Job.id == <candidate subquery>``; ``ctes`` are CTEs it refers to): ``(UPDATE …
    RETURNING the jobs, the same UPDATE plus one ``claimed`` event INSERT per job as one
    PostgreSQL statement of data-modifying CTEs)``. Shared by the single and the batch claim,
    so both set the same columns and write the same event. Parameters: ``claim_worker_id``,
    ``claim_lease_until``, ``claim_now``."""
    claim = update(Job)
    for cte in ctes:
        claim = claim.add_cte(cte)
    claim = claim.where(
        picked,
        Job.state == JobState.QUEUED.value,
        Job.cancel_requested.is_(False),
    ).values(
        state=JobState.STARTING.value,
        worker_id=bindparam("claim_worker_id"),
        lease_expires_at=bindparam("claim_lease_until", type_=UTCDateTime()),
        updated_at=bindparam("claim_now", type_=UTCDateTime()),
    )
    claimed = claim.returning(*Job.__table__.c).cte("claimed")
    add_events = events.claim_events_from(claimed)
    # Jobs loaded from a Core SELECT of the CTE (from_statement), not select(aliased(Job,
    # claimed)): an aliased entity adapts its columns lazily, on the shared statement, and
    # threads compiling it for the first time at once (a fresh API process taking its first
    # claims) could compile "SELECT claimed.id, …, jobs.attempt, … FROM claimed, jobs": one
    # row per job in the table, most columns from other jobs' rows, cached for the process.
    returned = select(Job).from_statement(select(*claimed.c).add_cte(add_events))
    return claim.returning(Job), returned


def claimed_job(job: Job) -> ClaimedJob:
    """A claimed ``job`` as the worker gets it: attempt, restarts, ``max_restarts`` from its
    spec, the spec itself and its owner (no attempt token yet)."""
    spec = dict(job.spec)
    return ClaimedJob(
        job.id, job.attempt, job.restarts, int(spec.get("max_restarts", 0)), spec,
        owner=job.owner,
    )  # fmt: skip
