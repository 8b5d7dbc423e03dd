"""The batch claim: up to N queued trials of one sweep at once, for a launcher that starts them
together (Slurm: one job array per batch).

The batch is the sweep of the best claimable job (highest priority, then oldest: the order of
``claims.claim_next_job``); a plain job (no sweep) is claimed alone. Claimable means
``claims._claimable``, the one predicate every claim uses. The sweep's ``max_concurrent`` is
held here too: a batch never takes more trials than ``max_concurrent`` minus the sweep's
trials already starting or running. Claimers of one sweep are serialised (PostgreSQL: the
sweep's transaction-scoped advisory lock that ``claims.claim_next_job`` takes too, then the
count in a statement of its own so it sees what the previous claimer committed; SQLite: the
session's ``BEGIN IMMEDIATE``);
the trials themselves are taken with one ``UPDATE … WHERE id IN (SELECT … FOR UPDATE SKIP
LOCKED LIMIT n) AND state = 'queued' RETURNING`` and their ``claimed`` events, one statement
on PostgreSQL.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import bindparam, func, select, text
from sqlalchemy.orm import Session

from service.store.jobs import claims
from service.store.jobs.claims import (
    _CLAIM_EVENT,
    HOLDING_STATES,
    SWEEP_CLAIM_LOCK_CLASS,
    _claimable,
)
from service.store.models import Job, Sweep, utcnow


@dataclass(frozen=True)
class ClaimedBatch:
    """What one batch claim took: ``jobs`` (now ``starting``, leased to the claimer; best
    first), all of sweep ``sweep_id`` — or one plain job, ``sweep_id`` None — and that sweep's
    ``max_concurrent`` (None: no limit), which a launcher passes on (Slurm's array
    parallelism)."""

    jobs: list[Job]
    sweep_id: int | None
    max_concurrent: int | None


def claim_trial_batch(
    session: Session,
    *,
    worker_id: str,
    launcher: str,
    max_gpus_per_node: int,
    lease_s: float,
    limit: int,
) -> ClaimedBatch | None:
    """Claim up to ``limit`` queued trials of the sweep whose trial is the best claimable job,
    or that job alone when it belongs to no sweep.

    Args:
        limit: most jobs to take (the claimer's free slots), ≥ 1.
    Returns:
        The batch (never empty), or None when nothing claimable is queued or the best job's
        sweep already has ``max_concurrent`` trials starting or running.
    Raises:
        ValueError: ``limit`` < 1.
    """
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    head = session.execute(
        select(Job.id, Job.sweep_id)
        .where(*_claimable(launcher, max_gpus_per_node))
        .order_by(Job.priority.desc(), Job.id)
        .limit(1)
    ).first()
    if head is None:
        return None
    if head.sweep_id is None:
        return _claim_one(
            session,
            worker_id=worker_id,
            launcher=launcher,
            max_gpus_per_node=max_gpus_per_node,
            lease_s=lease_s,
        )
    sweep_id = int(head.sweep_id)
    if session.get_bind().dialect.name == "postgresql":
        # SQLite's write lock (BEGIN IMMEDIATE) serialises every claimer already.
        session.execute(
            text("SELECT pg_advisory_xact_lock(:lock_class, CAST(:lock_key AS integer))"),
            {"lock_class": SWEEP_CLAIM_LOCK_CLASS, "lock_key": sweep_id % 2**31},
        )
    max_concurrent = session.scalar(select(Sweep.max_concurrent).where(Sweep.id == sweep_id))
    n = limit
    if max_concurrent is not None:
        active = session.scalar(
            select(func.count())
            .select_from(Job)
            .where(Job.sweep_id == sweep_id, Job.state.in_(HOLDING_STATES))
        )
        n = min(limit, int(max_concurrent) - int(active or 0))
    if n < 1:
        return None
    jobs = _claim_trials(
        session,
        sweep_id=sweep_id,
        n=n,
        worker_id=worker_id,
        launcher=launcher,
        max_gpus_per_node=max_gpus_per_node,
        lease_s=lease_s,
    )
    if not jobs:
        return None
    return ClaimedBatch(jobs=jobs, sweep_id=sweep_id, max_concurrent=max_concurrent)


def _claim_one(session: Session, **kw: Any) -> ClaimedBatch | None:
    """``claims.claim_next_job``: another claimer may have taken the head meanwhile, so the job
    claimed may be a sweep's trial after all (a batch of one)."""
    job = claims.claim_next_job(session, **kw)
    if job is None:
        return None
    limit = None
    if job.sweep_id is not None:
        limit = session.scalar(select(Sweep.max_concurrent).where(Sweep.id == job.sweep_id))
    return ClaimedBatch(jobs=[job], sweep_id=job.sweep_id, max_concurrent=limit)


def _claim_trials(
    session: Session,
    *,
    sweep_id: int,
    n: int,
    worker_id: str,
    launcher: str,
    max_gpus_per_node: int,
    lease_s: float,
) -> list[Job]:
    now = utcnow()
    # "claim_" names, as in claims.py: a parameter named like a column becomes a SET clause.
    params = {
        "claim_launcher": launcher,
        "claim_max_gpus": max_gpus_per_node,
        "claim_sweep_id": sweep_id,
        "claim_n": n,
        "claim_worker_id": worker_id,
        "claim_lease_until": now + timedelta(seconds=lease_s),
        "claim_now": now,
    }
    return _run_claim(session, _batch_statements(), params)


def _run_claim(session: Session, statements: tuple[Any, Any], params: dict[str, Any]) -> list[Job]:
    """Run a many-job claim (``claims.claim_update_statements``' pair) with ``params``: the
    jobs it took, best first, each with its ``claimed`` event."""
    load = {"populate_existing": True}
    claim, claim_with_events = statements
    if session.get_bind().dialect.name == "postgresql":
        jobs = list(session.scalars(claim_with_events, params, execution_options=load))
    else:
        jobs = list(
            session.scalars(claim, params, execution_options={**load, "synchronize_session": False})
        )
        if jobs:
            session.execute(
                _CLAIM_EVENT,
                [{"claim_job_id": j.id, "claim_attempt": j.attempt, **params} for j in jobs],
            )
    # RETURNING keeps no order: best first, as the claim chose them.
    return sorted(jobs, key=lambda j: (-j.priority, j.id))


@functools.cache
def _batch_statements() -> tuple[Any, Any]:
    """The batch claim, built once with bound parameters: ``(UPDATE … RETURNING the jobs, the
    same UPDATE plus its events INSERT as one PostgreSQL statement of data-modifying CTEs)``."""
    # A MATERIALIZED CTE, run once: as a plain ``IN (SELECT … LIMIT n FOR UPDATE SKIP
    # LOCKED)`` PostgreSQL may rescan the subquery while it updates, skipping the rows it has
    # just taken and taking the next ones, far past LIMIT.
    candidates = (
        select(Job.id)
        .where(
            *_claimable(bindparam("claim_launcher"), bindparam("claim_max_gpus")),
            Job.sweep_id == bindparam("claim_sweep_id"),
        )
        .order_by(Job.priority.desc(), Job.id)
        .limit(bindparam("claim_n"))
        .with_for_update(skip_locked=True)
        .cte("candidates")
        .prefix_with("MATERIALIZED")
    )
    return claims.claim_update_statements(Job.id.in_(select(candidates.c.id)), candidates)


def claim_next_jobs(
    session: Session,
    *,
    worker_id: str,
    launcher: str,
    max_gpus_per_node: int,
    lease_s: float,
    limit: int,
) -> list[Job]:
    """Claim up to ``limit`` of the best queued jobs that fit, in the order of
    ``claims.claim_next_job`` (highest priority, then oldest), for a worker with that many
    free slots: one ``UPDATE … WHERE id IN (SELECT … FOR UPDATE SKIP LOCKED LIMIT n)``
    statement with its events, as the batch claim's, on any jobs (plain jobs and trials of
    any sweeps). ``limit`` 1 is ``claims.claim_next_job`` itself.

    The statement tests each sweep's ``max_concurrent`` once, so it may take more of one
    sweep's trials than the sweep has places: each sweep's trials among them are then
    counted under its claim lock (sweeps in id order, so two claimers never wait on each
    other's locks) and the excess claims undone, the worst first, in this transaction.

    Args:
        limit: most jobs to take (the worker's free slots), ≥ 1.
    Returns:
        The jobs, now ``starting`` and leased to ``worker_id`` for ``lease_s`` seconds, best
        first; empty when nothing fits.
    Raises:
        ValueError: ``limit`` < 1.
    """
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    if limit == 1:
        job = claims.claim_next_job(
            session, worker_id=worker_id, launcher=launcher,
            max_gpus_per_node=max_gpus_per_node, lease_s=lease_s,
        )  # fmt: skip
        return [] if job is None else [job]
    now = utcnow()
    params = {
        "claim_launcher": launcher,
        "claim_max_gpus": max_gpus_per_node,
        "claim_n": limit,
        "claim_worker_id": worker_id,
        "claim_lease_until": now + timedelta(seconds=lease_s),
        "claim_now": now,
    }
    jobs = _run_claim(session, _next_jobs_statements(), params)
    kept = list(jobs)
    for sweep_id in sorted({j.sweep_id for j in jobs if j.sweep_id is not None}):
        excess = claims.over_sweep_limit(session, sweep_id)
        trials = [j for j in jobs if j.sweep_id == sweep_id]
        for job in trials[len(trials) - min(excess, len(trials)) :]:
            kept.remove(job)
            claims.unclaim(session, job)
    return kept


@functools.cache
def _next_jobs_statements() -> tuple[Any, Any]:
    """``claim_next_jobs``' claim, built once with bound parameters (as ``_batch_statements``,
    without the sweep)."""
    candidates = (
        select(Job.id)
        .where(*_claimable(bindparam("claim_launcher"), bindparam("claim_max_gpus")))
        .order_by(Job.priority.desc(), Job.id)
        .limit(bindparam("claim_n"))
        .with_for_update(skip_locked=True)
        .cte("candidates")
        .prefix_with("MATERIALIZED")
    )
    return claims.claim_update_statements(Job.id.in_(select(candidates.c.id)), candidates)
