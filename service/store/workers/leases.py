"""Who may act for a job: worker heartbeats (lease renewal), requeue of expired leases,
adoption of detached jobs, and the attempt fence.

A worker holds a job while its lease (``jobs.lease_expires_at``) is in the future; every
heartbeat renews the leases of the jobs it holds. A job whose lease ran out goes back to the
queue as attempt + 1 (``requeue_expired_jobs``), unless it is ``adoptable``: a job of a
detached launcher that adopts (Slurm) already submitted to its backend keeps running without
its worker, and a worker of that launcher takes it over (``adopt_detached_jobs``) instead of
starting a second copy. Writes on behalf of an attempt (metrics, checkpoints) pass the fence
(``check_attempt``): only the job's current, active attempt may write.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, cast

from sqlalchemy import ColumnElement, CursorResult, Row, and_, not_, or_, select, update
from sqlalchemy.orm import Session

from service.core.errors import JobNotFoundError, NotFoundError, StaleAttemptError, StaleStateError
from service.core.events import EventKind, render
from service.core.holds import AdoptedJob, HeldJob, Transition
from service.core.launchers import adopting_launchers, launcher_traits
from service.core.states import ACTIVE_STATES, JobState
from service.store.jobs.crud import apply_transition_where, cancel_flagged_queued_jobs
from service.store.models import Job, Worker, utcnow

log = logging.getLogger(__name__)

WORKER_LOST_REASON = render(EventKind.WORKER_LOST)  # "worker lost: lease expired"
_ACTIVE = frozenset(s.value for s in ACTIVE_STATES)


def adoptable() -> ColumnElement[bool]:
    """The condition of a job that a worker may adopt rather than requeue: its launcher's
    traits say ``adopts`` and the job was submitted to the backend (it has a
    ``scheduler_job_id``), so it runs on without its worker. The one rule shared by
    ``adopt_detached_jobs`` (adopt these) and ``requeue_expired_jobs`` (skip these)."""
    return and_(Job.launcher.in_(adopting_launchers()), Job.scheduler_job_id.is_not(None))


# -- heartbeat -----------------------------------------------------------------------------


def heartbeat(session: Session, worker_id: str, *, lease_s: float) -> list[HeldJob]:
    """Stamp the worker alive and extend to now + ``lease_s`` seconds the lease of every
    active job it holds.

    Returns:
        The jobs the database says this worker holds (a job moved away from it, e.g. requeued
        by a reaper, is absent: the worker must stop it).
    Raises:
        NotFoundError: the worker is not registered.
    """
    now = utcnow()
    result = session.execute(update(Worker).where(Worker.id == worker_id).values(heartbeat_at=now))
    updated = cast(CursorResult[Any], result).rowcount
    if not updated:
        raise NotFoundError(f"worker {worker_id} is not registered")
    active = [s.value for s in ACTIVE_STATES]
    session.execute(
        update(Job)
        .where(Job.worker_id == worker_id, Job.state.in_(active))
        .values(lease_expires_at=now + timedelta(seconds=lease_s))
    )
    rows = session.execute(
        select(Job.id, Job.attempt, Job.state, Job.cancel_requested).where(
            Job.worker_id == worker_id, Job.state.in_(active)
        )
    )
    return [HeldJob(r.id, r.attempt, r.state, bool(r.cancel_requested)) for r in rows]


# -- requeue of expired leases -------------------------------------------------------------


def requeue_expired_jobs(session: Session, *, limit: int = 100) -> list[Transition]:
    """Requeue active jobs whose worker stopped renewing their lease (a lost worker).

    Each job moves ``starting|running → queued`` (attempt + 1, restarts unchanged) in one
    compare-and-set that also re-checks the lease, so a worker that just renewed it keeps
    its job. A job whose cancel was requested ends ``cancelled`` instead (as in
    ``jobs.apply_transition``). At most ``limit`` jobs per call.

    ``adoptable`` jobs (Slurm jobs already submitted) are skipped: they keep running in their
    backend without their worker, and a worker of their launcher adopts them
    (``adopt_detached_jobs``); requeueing would start a second copy as attempt + 1.

    It also cancels queued jobs that carry ``cancel_requested``
    (``jobs.cancel_flagged_queued_jobs``).

    Returns:
        The transitions applied (target ``queued``, or ``cancelled`` for a flagged job).
    """
    now = utcnow()
    active = [JobState.STARTING.value, JobState.RUNNING.value]
    not_adoptable = not_(adoptable())
    rows = session.execute(
        select(Job.id, Job.state)
        .where(Job.state.in_(active), Job.lease_expires_at < now, not_adoptable)
        .order_by(Job.id)
        .limit(limit)
    ).all()
    done: list[Transition] = []
    for job_id, state in rows:
        t = Transition.of(job_id, JobState(state), JobState.QUEUED, EventKind.WORKER_LOST)
        try:
            _, applied = apply_transition_where(
                session, t, where=[Job.lease_expires_at < now, not_adoptable]
            )
        except (StaleStateError, NotFoundError):
            continue  # renewed, moved or deleted since the select
        done.append(applied)
    done += cancel_flagged_queued_jobs(session, limit=limit)
    session.flush()
    return done


# -- adoption of detached jobs -------------------------------------------------------------


def adopter_of(session: Session, job_id: int, attempt: int, worker_id: str) -> str | None:
    """The worker other than ``worker_id`` that adopted ``attempt`` of job ``job_id`` and
    still holds it active, if any (its detached job must keep running); None when the job
    was requeued, ended or is gone instead."""
    job = session.get(Job, job_id)
    if job is None:
        return None
    adopted = (
        job.attempt == attempt
        and not JobState(job.state).is_terminal
        and job.worker_id not in (None, worker_id)
    )
    return job.worker_id if adopted else None


def adopt_detached_jobs(
    session: Session, *, worker_id: str, launcher: str, lease_s: float, limit: int = 100
) -> list[AdoptedJob]:
    """Take over the ``adoptable`` active jobs of launcher ``launcher`` whose worker is gone:
    its lease on them expired, or it stopped (its row has ``stopped_at``). A job not yet
    submitted to the backend (no ``scheduler_job_id``) is the reaper's to requeue; a
    launcher whose traits do not say ``adopts`` adopts nothing.

    Call it before ``requeue_expired_jobs`` in such a worker's tick (and at start-up). Each
    job is one compare-and-set on ``(id, state, attempt, worker_id)``, so two workers adopting
    at once never both get it, and a worker that just renewed its lease keeps its job.

    Args:
        worker_id: the adopting worker (registered).
        launcher: the adopting worker's launcher name (e.g. ``"slurm"``).
        lease_s: the new lease, seconds from now.
        limit: at most this many jobs per call.
    Returns:
        The jobs adopted by this call.
    """
    now = utcnow()
    stopped_workers = select(Worker.id).where(Worker.stopped_at.is_not(None))
    rows = session.execute(
        select(
            Job.id,
            Job.attempt,
            Job.state,
            Job.worker_id,
            Job.scheduler_job_id,
            Job.cancel_requested,
            Job.restarts,
            Job.spec,
        )
        .where(
            Job.launcher == launcher,
            adoptable(),
            Job.state.in_([s.value for s in ACTIVE_STATES]),
            or_(Job.worker_id.is_(None), Job.worker_id != worker_id),
            or_(
                Job.lease_expires_at.is_(None),
                Job.lease_expires_at < now,
                Job.worker_id.in_(stopped_workers),
            ),
        )
        .order_by(Job.id)
        .limit(limit)
    ).all()
    adopted: list[AdoptedJob] = []
    for row in rows:
        same_holder = (
            Job.worker_id.is_(None) if row.worker_id is None else Job.worker_id == row.worker_id
        )
        result = session.execute(
            update(Job)
            .where(
                Job.id == row.id,
                Job.state == row.state,
                Job.attempt == row.attempt,
                same_holder,
            )
            .values(worker_id=worker_id, lease_expires_at=now + timedelta(seconds=lease_s))
            .execution_options(synchronize_session=False)
        )
        if cast(CursorResult[Any], result).rowcount != 1:
            continue
        job = AdoptedJob(
            job_id=row.id,
            attempt=row.attempt,
            state=JobState(row.state),
            scheduler_job_id=str(row.scheduler_job_id),
            cancel_requested=bool(row.cancel_requested),
            previous_worker_id=row.worker_id,
            restarts=int(row.restarts or 0),
            max_restarts=int((row.spec or {}).get("max_restarts", 0)),
        )
        log.info(
            "job_id=%d attempt=%d: adopted %s job %s from worker %s",
            job.job_id,
            job.attempt,
            launcher_traits(launcher).title or launcher,
            job.scheduler_job_id,
            job.previous_worker_id,
            extra={"job_id": job.job_id, "attempt": job.attempt},
        )
        adopted.append(job)
    session.flush()
    return adopted


# -- the attempt fence ---------------------------------------------------------------------


def fence_attempt(job_id: int, attempt: int, row: Row[Any] | None) -> Row[Any]:
    """``row`` (a job's ``attempt``, ``state``, …) if ``attempt`` passes the fence: the job
    exists, ``attempt`` is its current one and it is active (starting/running).

    Raises:
        JobNotFoundError: ``row`` is None (no such job).
        StaleAttemptError: ``attempt`` is not current, or the job is not active.
    """
    if row is None:
        raise JobNotFoundError(job_id)
    if row.attempt != attempt or row.state not in _ACTIVE:
        raise StaleAttemptError(
            f"job {job_id} attempt {attempt} is stale (job is {row.state}, attempt {row.attempt})"
        )
    return row


def lock_attempt(session: Session, job_id: int, attempt: int) -> Row[Any]:
    """The fence of ``check_attempt`` on the few columns a write needs (no ORM entity):
    ``(attempt, state, latest_metrics)``, row-locked on PostgreSQL.

    Raises:
        NotFoundError / StaleAttemptError: see ``fence_attempt``.
    """
    stmt = select(Job.attempt, Job.state, Job.latest_metrics).where(Job.id == job_id)
    return fence_attempt(job_id, attempt, session.execute(stmt.with_for_update()).one_or_none())


def check_attempt(session: Session, job_id: int, attempt: int) -> Job:
    """Fence: the job must exist, hold ``attempt`` as its current attempt and be active.

    Takes the row lock on PostgreSQL so a concurrent requeue waits for this write.

    Raises:
        NotFoundError: no such job.
        StaleAttemptError: ``attempt`` is not current, or the job is not starting/running.
    """
    lock_attempt(session, job_id, attempt)
    job = session.get(Job, job_id)
    assert job is not None  # locked above
    return job


def spec_for_attempt(session: Session, job_id: int, attempt: int) -> dict[str, Any]:
    """The job's stored spec (JSON object, validate it with ``JobSpec.model_validate``) for a
    rank of ``attempt`` about to start, after the fence: the attempt must still be the job's
    current, active one. A plain read (no row lock): it writes nothing.

    Raises:
        NotFoundError: no such job.
        StaleAttemptError: the job moved on (requeued, cancelled, finished) before the rank
            started.
    """
    stmt = select(Job.attempt, Job.state, Job.spec).where(Job.id == job_id)
    row = fence_attempt(job_id, attempt, session.execute(stmt).one_or_none())
    return dict(row.spec or {})
