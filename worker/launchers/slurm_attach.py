"""Re-attaching to Slurm jobs that outlived their worker: adopt them by ``scheduler_job_id``.

A Slurm job keeps running when the worker that submitted it dies or restarts. Instead of the
lease reaper requeueing such a job (which would start a second copy as attempt + 1), a Slurm
worker adopts it: one compare-and-set per job moves ``worker_id`` to itself and renews the
lease, and the worker then follows the job with ``SlurmLauncher.poll(scheduler_job_id)`` (the
handle is the Slurm job id; the Slurm job name ties it to its ddpq attempt).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, or_, select, update
from sqlalchemy.orm import Session

from service.core.states import ACTIVE_STATES, JobState
from service.store.models import Job, Worker, utcnow

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdoptedJob:
    """A Slurm job this worker now holds; poll it with ``scheduler_job_id`` as the handle."""

    job_id: int
    attempt: int
    state: JobState
    scheduler_job_id: str
    cancel_requested: bool
    previous_worker_id: str | None
    restarts: int = 0  # relaunches after failures so far
    max_restarts: int = 0  # from the spec


def adopt_slurm_jobs(
    session: Session, *, worker_id: str, lease_s: float, limit: int = 100
) -> list[AdoptedJob]:
    """Take over active Slurm jobs whose worker is gone: its lease on them expired, or it
    stopped (its row has ``stopped_at``). Only jobs already submitted to Slurm (with a
    ``scheduler_job_id``) are adopted; the rest are the reaper's to requeue.

    Call it before ``service.store.jobs.requeue_expired_jobs`` in a Slurm worker's tick (and at
    start-up). Each job is one compare-and-set on ``(id, state, attempt, worker_id)``, so two
    workers adopting at once never both get it, and a worker that just renewed its lease keeps
    its job.

    Args:
        worker_id: the adopting worker (registered).
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
            Job.launcher == "slurm",
            Job.state.in_([s.value for s in ACTIVE_STATES]),
            Job.scheduler_job_id.is_not(None),
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
            "job_id=%d attempt=%d: adopted Slurm job %s from worker %s",
            job.job_id,
            job.attempt,
            job.scheduler_job_id,
            job.previous_worker_id,
            extra={"job_id": job.job_id, "attempt": job.attempt},
        )
        adopted.append(job)
    session.flush()
    return adopted
