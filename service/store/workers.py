"""Workers: registration, listing, why a queued job waits (heartbeats and leases are in
leases.py)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from service.core.launchers import uses_host_gpus
from service.core.states import ACTIVE_STATES, JobState
from service.store.models import Job, Worker, utcnow

# A worker is live while its last heartbeat is younger than this many heartbeat intervals.
LIVE_HEARTBEATS = 3


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


def _capacity_int(capacity: Any, key: str, default: int) -> int:
    value = capacity.get(key) if isinstance(capacity, dict) else None
    if key == "gpus":
        return len(value) if isinstance(value, list) else default
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def queue_reason(
    session: Session,
    *,
    job_id: int,
    launcher: str,
    gpus_per_node: int,
    priority: int,
    heartbeat_interval_s: float,
) -> str:
    """Why a queued job is still waiting, for people (two small queries; call it for one
    job, not for lists).

    Considers the live workers of the job's launcher (not stopped, heartbeat younger than
    ``LIVE_HEARTBEATS × heartbeat_interval_s`` seconds), their ``capacity`` (slots, GPUs)
    and the active jobs they hold; GPUs count only for launchers whose traits say
    ``host_gpus`` (``service.core.launchers``).

    Returns:
        e.g. ``"no live worker for launcher local"``, ``"waiting for a worker with 1 free
        GPU (live workers have at most 0)"``, ``"waiting for a free slot (…)"`` or
        ``"waiting for a worker to claim it (2 queued jobs ahead)"``.
    """
    cutoff = utcnow() - timedelta(seconds=LIVE_HEARTBEATS * heartbeat_interval_s)
    # Each live worker with what it holds, in one query (correlated counts, served by
    # ix_jobs_worker_id): this runs on every GET of a queued job.
    held_by_worker = [Job.worker_id == Worker.id, Job.state.in_([s.value for s in ACTIVE_STATES])]
    live = list(
        session.execute(
            select(
                Worker.id,
                Worker.capacity,
                select(func.count()).where(*held_by_worker).scalar_subquery(),
                select(func.coalesce(func.sum(Job.gpus_per_node), 0))
                .where(*held_by_worker)
                .scalar_subquery(),
            ).where(
                Worker.launcher == launcher,
                Worker.stopped_at.is_(None),
                Worker.heartbeat_at > cutoff,
            )
        )
    )
    if not live:
        hint = f"`ddpq worker --launcher {launcher}`"
        return f"no live worker for launcher {launcher} (start one: {hint})"
    host_gpus = uses_host_gpus(launcher)
    wants_gpus = gpus_per_node if host_gpus else 0
    free_slots, free_gpus, total_gpus = [], [], []
    for _wid, capacity, jobs_held, gpus_held in live:
        total = _capacity_int(capacity, "gpus", 0)
        free_slots.append(_capacity_int(capacity, "slots", 1) - int(jobs_held))
        free_gpus.append(total - int(gpus_held))
        total_gpus.append(total)
    if wants_gpus and max(total_gpus) < wants_gpus:
        return (
            f"waiting for a worker with {_plural(wants_gpus, 'free GPU')} "
            f"(live workers have at most {max(total_gpus)})"
        )
    fitting = [g for s, g in zip(free_slots, free_gpus, strict=True) if s > 0 and g >= wants_gpus]
    if not fitting:
        if wants_gpus and any(s > 0 for s in free_slots):
            return (
                f"waiting for {_plural(wants_gpus, 'free GPU')} on one worker "
                f"(live workers have at most {max(free_gpus)} free now)"
            )
        return f"waiting for a free slot ({_plural(len(live), 'live worker')}, all busy)"
    # Jobs the same workers would claim first: better priority (or older), and small enough.
    ahead_filter = [
        Job.state == JobState.QUEUED.value,
        Job.launcher == launcher,
        or_(Job.priority > priority, (Job.priority == priority) & (Job.id < job_id)),
    ]
    if host_gpus:
        ahead_filter.append(Job.gpus_per_node <= max(fitting))
    ahead = session.scalar(select(func.count()).where(*ahead_filter))
    if ahead:
        return f"waiting for a worker to claim it ({_plural(int(ahead), 'queued job')} ahead)"
    return "waiting for a worker to claim it"
