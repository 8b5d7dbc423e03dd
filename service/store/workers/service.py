"""The worker resource's use cases, each opening its own session: what a worker does with its
own row and the jobs it holds (register, heartbeat, stop, adopt, requeue lost workers' jobs),
and the list of workers the API shows. The worker reaches them through ``worker.records``
(its typed interface); ``service.store.jobs.service`` holds the claims and transitions,
``service.store.attempts.service`` the attempt tokens."""

from __future__ import annotations

from typing import Any

from service.core.holds import AdoptedJob, HeldJob, Transition
from service.store.db import Database
from service.store.jobs.crud import owned_job_ids
from service.store.models import Worker
from service.store.workers import leases, pruning, registry
from service.store.workers.values import WorkerView


def register_worker(
    db: Database, *, worker_id: str, host: str, pid: int, launcher: str, capacity: dict[str, Any]
) -> None:
    """Insert (or revive) the worker's row. ``capacity``: ``{"slots": int, "gpus": [int],
    "cpus": int}``."""
    with db.session() as session:
        registry.register_worker(
            session, worker_id=worker_id, host=host, pid=pid, launcher=launcher, capacity=capacity
        )


def record_heartbeat(db: Database, worker_id: str, *, lease_s: float) -> list[HeldJob]:
    """Stamp the worker alive and renew the leases of its active jobs (``lease_s`` seconds
    from now); the jobs the database says it holds (one moved away from it is absent).

    Raises:
        NotFoundError: the worker has no row (register again).
    """
    with db.session() as session:
        return leases.heartbeat(session, worker_id, lease_s=lease_s)


def stop_worker(db: Database, worker_id: str) -> None:
    """Mark the worker stopped (a clean shutdown: its detached jobs become adoptable)."""
    with db.session() as session:
        registry.stop_worker(session, worker_id)


def list_workers(db: Database, *, owner: str | None) -> list[WorkerView]:
    """Every worker, newest heartbeat first, with the ids of the active jobs it holds: only
    ``owner``'s jobs (None: every job), so other owners' job ids do not leak."""
    with db.session(write=False) as session:
        rows = registry.list_workers(session)
        if owner is not None:
            mine = owned_job_ids(session, [j for _, held in rows for j in held], owner)
            rows = [(w, [j for j in held if j in mine]) for w, held in rows]
        return [_view(w, held) for w, held in rows]


def has_live_worker(
    db: Database, *, launcher: str, heartbeat_interval_s: float, pid: int | None = None
) -> bool:
    """Whether a live worker of ``launcher`` (with ``pid``, if given) is registered: what
    /readyz waits for under ``Settings.expect_worker``, and ``ddpq up`` for its own worker."""
    with db.session(write=False) as session:
        return registry.has_live_worker(
            session, launcher=launcher, heartbeat_interval_s=heartbeat_interval_s, pid=pid
        )


def _view(worker: Worker, held: list[int]) -> WorkerView:
    w = worker
    return WorkerView(
        w.id, w.host, w.pid, w.launcher, w.capacity, w.started_at, w.heartbeat_at,
        w.stopped_at, tuple(held),
    )  # fmt: skip


def requeue_expired_jobs(db: Database) -> list[Transition]:
    """Requeue (or cancel, if flagged) every active job whose lease expired
    (``leases.requeue_expired_jobs``); the transitions applied."""
    with db.session() as session:
        return leases.requeue_expired_jobs(session)


def find_adopter(db: Database, job_id: int, attempt: int, *, worker_id: str) -> str | None:
    """The worker other than ``worker_id`` that adopted ``attempt`` of the job and still holds
    it active, if any; None when it was requeued, ended or is gone instead."""
    with db.session(write=False) as session:
        return leases.adopter_of(session, job_id, attempt, worker_id)


def adopt_detached_jobs(
    db: Database, *, worker_id: str, launcher: str, lease_s: float
) -> list[AdoptedJob]:
    """Take over the detached jobs of ``launcher`` whose worker is lost or stopped
    (``leases.adopt_detached_jobs``); the jobs adopted, leased for ``lease_s`` seconds."""
    with db.session() as session:
        return leases.adopt_detached_jobs(
            session, worker_id=worker_id, launcher=launcher, lease_s=lease_s
        )


def prune_stopped_workers(db: Database, *, retention_s: float) -> list[str]:
    """Delete the rows of workers stopped more than ``retention_s`` seconds ago that no job
    names (``pruning.prune_stopped_workers``); their ids, sorted.

    Raises:
        ValueError: ``retention_s`` is not positive.
    """
    with db.session() as session:
        return pruning.prune_stopped_workers(session, retention_s=retention_s)
