"""The worker resource's use cases, each opening its own session: what a worker does with its
own row and the jobs it holds (register, heartbeat, claim with attempt tokens, fenced
transitions and notes, adopt, stop, requeue lost workers' jobs), and the list of workers the
API shows. The worker API's routes (``service.api.workers.self_routes``) call them, each
fenced on the calling worker: it acts only on the jobs it holds (``held``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from service.core.events import EventKind
from service.core.holds import AdoptedJob, ClaimedJobs, HeldJob, SchedulerHandle, Transition
from service.core.states import JobState
from service.store.db import Database
from service.store.jobs import batch_claims, claims, crud, notes
from service.store.jobs.crud import owned_job_ids
from service.store.jobs.queue import LIVE_HEARTBEATS
from service.store.models import Job, Worker, utcnow
from service.store.workers import held, leases, pruning, registry
from service.store.workers.values import WorkerCaller, WorkerView


def register_worker(
    db: Database,
    *,
    worker_id: str,
    host: str,
    pid: int,
    launcher: str,
    capacity: dict[str, Any],
    token_id: int | None = None,
) -> None:
    """Insert (or revive) the worker's row, registered with worker token ``token_id``.
    ``capacity``: ``{"slots": int, "gpus": [int], "cpus": int}``.

    Raises:
        WorkerTokenMismatchError: the id is registered with another worker token (403).
    """
    with db.session() as session:
        registry.register_worker(
            session, worker_id=worker_id, host=host, pid=pid, launcher=launcher,
            capacity=capacity, token_id=token_id,
        )  # fmt: skip


def find_worker_caller(db: Database, token: str, worker_id: str) -> WorkerCaller | None:
    """Who calls the worker API (``held.find_worker_caller``): None for an unknown, revoked
    or non-worker token.

    Raises:
        DatabaseUnavailableError: the token could not be looked up (503).
    """
    # A Core read (no ORM session): it runs before every worker request.
    return db.read(lambda conn: held.find_worker_caller(conn, token, worker_id))


def claim_for_worker(
    db: Database,
    *,
    worker_id: str,
    launcher: str,
    max_gpus_per_node: int,
    lease_s: float,
    batch_limit: int | None = None,
    token_id: int | None = None,
    limit: int = 1,
) -> ClaimedJobs | None:
    """Claim the next ``limit`` jobs (``batch_limit`` None; ``batch_claims.claim_next_jobs``)
    or up to ``batch_limit`` trials of one sweep for ``worker_id`` (leased ``lease_s``
    seconds, now ``starting``), each with a new attempt token for its ranks, all in one
    transaction; None when nothing is claimable. With ``token_id``, the calling worker token
    must still be live in that transaction (a long poll outlasts the check of its request).

    Raises:
        WorkerTokenRefusedError: ``token_id`` was revoked (401); nothing claimed.
        ValueError: ``limit`` < 1.
    """
    with db.session() as session:
        if token_id is not None:
            held.check_token_live(session, token_id)
        if batch_limit is None:
            taken = batch_claims.claim_next_jobs(
                session, worker_id=worker_id, launcher=launcher,
                max_gpus_per_node=max_gpus_per_node, lease_s=lease_s, limit=limit,
            )  # fmt: skip
            if not taken:
                return None
            found = ClaimedJobs(tuple(claims.claimed_job(j) for j in taken), None, None)
        else:
            batch = batch_claims.claim_trial_batch(
                session, worker_id=worker_id, launcher=launcher,
                max_gpus_per_node=max_gpus_per_node, lease_s=lease_s, limit=batch_limit,
            )  # fmt: skip
            if batch is None:
                return None
            jobs = tuple(claims.claimed_job(j) for j in batch.jobs)
            found = ClaimedJobs(jobs, batch.sweep_id, batch.max_concurrent)
        jobs = tuple(held.mint_claim_tokens(session, found.jobs))
        return ClaimedJobs(jobs, found.sweep_id, found.max_concurrent)


def apply_held_transition(
    db: Database,
    t: Transition,
    *,
    worker_id: str,
    error: str | None = None,
    values: Mapping[str, Any] | None = None,
) -> JobState:
    """Apply ``t`` to a job ``worker_id`` holds (one compare-and-set that also requires
    ``jobs.worker_id`` to be it, with its event); the state it produced.

    Raises:
        InvalidTransitionError: the table forbids ``t``.
        StaleStateError: the job had moved on, or another worker holds it.
        NotFoundError: no such job.
    """
    with db.session() as session:
        job, _ = crud.apply_transition_where(
            session, t, worker_id=worker_id, error=error, values=dict(values or {}) or None,
            where=[Job.worker_id == worker_id],
        )  # fmt: skip
        return JobState(job.state)


def record_held_handles(db: Database, handles: Sequence[SchedulerHandle], *, worker_id: str) -> int:
    """Store detached launchers' handles of jobs ``worker_id`` holds (each fenced on its
    attempt and holder), in one transaction; how many were stored."""
    with db.session() as session:
        return held.record_held_handles(session, handles, worker_id)


def note_held_job(
    db: Database,
    job_id: int,
    attempt: int,
    kind: EventKind,
    data: Mapping[str, Any],
    *,
    worker_id: str,
    pending: tuple[str, str] | None = None,
) -> bool:
    """Add a note of ``kind`` with ``data`` to the events of ``attempt`` of a job
    ``worker_id`` holds; or, with ``pending`` = ``(code, words)``, the batch scheduler's
    pending reason unless it is the newest one recorded. Whether an event was written.

    Raises:
        NotHeldError: the worker does not hold the job at that attempt (404).
        KeyError: ``data`` lacks a field the kind's wording needs.
    """
    with db.session() as session:
        held.check_held(session, job_id, attempt, worker_id)
        if pending is not None:
            return notes.record_scheduler_pending(
                session, job_id, attempt, *pending, worker_id=worker_id
            )
        notes.record_job_note(session, job_id, attempt, kind, data, worker_id=worker_id)
        return True


def record_heartbeat(
    db: Database, worker_id: str, *, lease_s: float, token_id: int | None = None
) -> list[HeldJob]:
    """Stamp the worker alive and renew the leases of its active jobs (``lease_s`` seconds
    from now); the jobs the database says it holds (one moved away from it is absent). With
    ``token_id``, the calling worker token must still be live in that transaction, so no
    lease of a revoked token's worker is renewed.

    Raises:
        NotFoundError: the worker has no row (register again).
        WorkerTokenRefusedError: ``token_id`` was revoked (401); nothing renewed.
    """
    with db.session() as session:
        if token_id is not None:
            held.check_token_live(session, token_id)
        return leases.heartbeat(session, worker_id, lease_s=lease_s)


def stop_worker(db: Database, worker_id: str) -> None:
    """Mark the worker stopped (a clean shutdown: its detached jobs become adoptable)."""
    with db.session() as session:
        registry.stop_worker(session, worker_id)


def list_workers(
    db: Database, *, owner: str | None, heartbeat_interval_s: float = 5.0
) -> list[WorkerView]:
    """Every worker, newest heartbeat first, with the ids of the active jobs it holds: only
    ``owner``'s jobs (None: every job), so other owners' job ids do not leak. Each is
    ``live``, ``lost`` (no heartbeat within ``LIVE_HEARTBEATS`` × ``heartbeat_interval_s``
    seconds: what the queue explanation and the submit warning do not count) or
    ``stopped``."""
    with db.session(write=False) as session:
        rows = registry.list_workers(session)
        if owner is not None:
            mine = owned_job_ids(session, [j for _, held in rows for j in held], owner)
            rows = [(w, [j for j in held if j in mine]) for w, held in rows]
        live_after = utcnow() - timedelta(seconds=LIVE_HEARTBEATS * heartbeat_interval_s)
        return [_view(w, held, live_after) for w, held in rows]


def has_live_worker(
    db: Database, *, launcher: str, heartbeat_interval_s: float, pid: int | None = None
) -> bool:
    """Whether a live worker of ``launcher`` (with ``pid``, if given) is registered: what
    /readyz waits for under ``Settings.expect_worker``, and ``ddpq up`` for its own worker."""
    with db.session(write=False) as session:
        return registry.has_live_worker(
            session, launcher=launcher, heartbeat_interval_s=heartbeat_interval_s, pid=pid
        )


def _view(worker: Worker, held: list[int], live_after: datetime) -> WorkerView:
    w = worker
    status = "stopped" if w.stopped_at else "live" if w.heartbeat_at > live_after else "lost"
    return WorkerView(
        w.id, w.host, w.pid, w.launcher, w.capacity, w.started_at, w.heartbeat_at,
        w.stopped_at, tuple(held), status,
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
