"""Retention of worker rows: a stopped worker's row is deleted once it is old enough.

Every ``ddpq worker`` start with a fresh id adds a row; without pruning the workers page and
``GET /workers`` grow forever. Only rows that nothing needs any more go: stopped (a clean
shutdown stamped ``stopped_at``) longer ago than the retention, and held by no job.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import delete, exists, select
from sqlalchemy.orm import Session

from service.store.models import Job, Worker, utcnow


def prune_stopped_workers(session: Session, *, retention_s: float) -> list[str]:
    """Delete the workers stopped more than ``retention_s`` seconds ago that no job row
    names (a worker that holds a job, whatever its state, is kept; so is every worker
    without ``stopped_at``, however old its heartbeat). One DELETE with the conditions in
    its WHERE, so a worker that re-registers (clearing ``stopped_at``) or claims a job
    meanwhile is not deleted.

    Returns:
        The ids deleted, sorted.

    Raises:
        ValueError: ``retention_s`` is not positive.
    """
    if not retention_s > 0:
        raise ValueError(f"retention_s must be > 0 seconds, not {retention_s!r}")
    cutoff = utcnow() - timedelta(seconds=retention_s)
    held = exists(select(Job.id).where(Job.worker_id == Worker.id))
    conditions = (Worker.stopped_at.is_not(None), Worker.stopped_at < cutoff, ~held)
    stmt = delete(Worker).where(*conditions).returning(Worker.id)
    deleted = session.scalars(stmt, execution_options={"synchronize_session": False})
    return sorted(deleted)
