"""Worker registration, heartbeats (which renew the leases of the jobs a worker holds)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, select, update
from sqlalchemy.orm import Session

from service.errors import NotFoundError
from service.models import Job, Worker, utcnow
from service.states import ACTIVE_STATES


@dataclass(frozen=True)
class HeldJob:
    """What a heartbeat tells a worker about one job it holds."""

    job_id: int
    attempt: int
    state: str
    cancel_requested: bool


def register_worker(
    session: Session,
    *,
    worker_id: str,
    host: str,
    pid: int,
    launcher: str,
    capacity: dict[str, Any],
) -> Worker:
    """Insert (or revive) the worker row. ``capacity``: ``{"slots": int, "gpus": [int]}``."""
    now = utcnow()
    worker = session.get(Worker, worker_id)
    if worker is None:
        worker = Worker(id=worker_id)
        session.add(worker)
    worker.host, worker.pid, worker.launcher, worker.capacity = host, pid, launcher, capacity
    worker.started_at = worker.heartbeat_at = now
    worker.stopped_at = None
    session.flush()
    return worker


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


def stop_worker(session: Session, worker_id: str) -> None:
    """Mark the worker stopped (a clean shutdown)."""
    session.execute(update(Worker).where(Worker.id == worker_id).values(stopped_at=utcnow()))


def list_workers(session: Session) -> list[tuple[Worker, list[int]]]:
    """Every worker, newest heartbeat first, with the ids of the active jobs it holds."""
    workers = list(session.scalars(select(Worker).order_by(Worker.heartbeat_at.desc())))
    held: dict[str, list[int]] = {}
    rows = session.execute(
        select(Job.worker_id, Job.id).where(
            Job.worker_id.is_not(None), Job.state.in_([s.value for s in ACTIVE_STATES])
        )
    )
    for wid, jid in rows:
        held.setdefault(str(wid), []).append(jid)
    return [(w, sorted(held.get(w.id, []))) for w in workers]
