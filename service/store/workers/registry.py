"""Workers: registration, listing, why a queued job waits (heartbeats and leases are in
leases.py)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.core.errors import WorkerTokenMismatchError
from service.core.holds import HeldJob
from service.core.states import ACTIVE_STATES
from service.store.jobs.queue import LIVE_HEARTBEATS, explain_queue
from service.store.jobs.values import JobShape
from service.store.models import Job, Worker, utcnow

__all__ = [
    "LIVE_HEARTBEATS",
    "HeldJob",
    "has_live_worker",
    "list_workers",
    "queue_reason",
    "register_worker",
    "stop_worker",
]


def register_worker(
    session: Session,
    *,
    worker_id: str,
    host: str,
    pid: int,
    launcher: str,
    capacity: dict[str, Any],
    token_id: int | None = None,
) -> Worker:
    """Insert (or revive) the worker row. ``capacity``: ``{"slots": int, "gpus": [int]}``;
    ``token_id``: the worker token it registers with (None: a worker on the database itself,
    in tests).

    Raises:
        WorkerTokenMismatchError: the id is registered with another worker token, or (for a
            worker token) with none: a row from before worker tokens keeps the jobs it held,
            and no token may take them over by naming its id.
    """
    now = utcnow()
    worker = session.get(Worker, worker_id, with_for_update=True)
    if worker is None:
        worker = Worker(id=worker_id, token_id=token_id)
        session.add(worker)
    elif worker.token_id != token_id:
        whose = "another worker token" if worker.token_id is not None else "no worker token"
        raise WorkerTokenMismatchError(f"worker id {worker_id} is registered with {whose}")
    worker.token_id = token_id
    worker.host, worker.pid, worker.launcher, worker.capacity = host, pid, launcher, capacity
    worker.started_at = worker.heartbeat_at = now
    worker.stopped_at = None
    session.flush()
    return worker


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


def has_live_worker(
    session: Session, *, launcher: str, heartbeat_interval_s: float, pid: int | None = None
) -> bool:
    """Whether a worker of ``launcher`` (with ``pid``, if given) is registered, not stopped,
    and beat within ``LIVE_HEARTBEATS`` intervals."""
    live_after = utcnow() - timedelta(seconds=LIVE_HEARTBEATS * heartbeat_interval_s)
    query = select(Worker.id).where(
        Worker.launcher == launcher,
        Worker.stopped_at.is_(None),
        Worker.heartbeat_at > live_after,
    )
    if pid is not None:
        query = query.where(Worker.pid == pid)
    return session.scalar(query.limit(1)) is not None


def queue_reason(
    session: Session,
    *,
    job_id: int,
    launcher: str,
    gpus_per_node: int,
    priority: int,
    heartbeat_interval_s: float,
    nproc_per_node: int = 1,
    max_gpus_per_node: int = 0,
) -> str:
    """Why a queued job is still waiting, for people: the ``summary`` of
    ``service.store.jobs.queue.explain_queue`` (kept for callers that want the one line).

    Returns:
        e.g. ``"no live worker for launcher local (start one: …)"``, ``"waiting for a worker
        with 1 free GPU (live workers have at most 0)"``, ``"waiting for a free slot (…)"`` or
        ``"waiting for a worker to claim it (2 queued jobs ahead)"``.
    """
    shape = JobShape(launcher, gpus_per_node, nproc_per_node, priority, job_id=job_id)
    return explain_queue(
        session,
        shape,
        viewer=None,
        heartbeat_interval_s=heartbeat_interval_s,
        max_gpus_per_node=max_gpus_per_node,
    ).summary
