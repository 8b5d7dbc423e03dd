"""What a worker reads and writes in the database, one short session per call.

``WorkerLoop`` decides; this module holds the store calls it makes (register, heartbeat,
claim, mint an attempt's token, record a detached handle, apply a transition, reap, adopt,
stop), so that the loop
reads as orchestration and every write is one transaction of ``service.store``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.core.errors import NotFoundError, StaleAttemptError
from service.core.events import EventKind
from service.core.states import JobState
from service.store.attempts import tokens as attempt_tokens
from service.store.db import Database
from service.store.jobs import batch_claims, claims
from service.store.jobs import crud as jobs
from service.store.jobs import notes as job_notes
from service.store.models import Job
from service.store.workers import leases
from service.store.workers import registry as workers
from service.store.workers.registry import HeldJob
from worker.decisions import Decision, HeldRun


@dataclass(frozen=True)
class ClaimedRuns:
    """A batch claim as the loop sees it: each job's run and stored spec (best first), the
    sweep they belong to (None: one plain job) and its ``max_concurrent``."""

    claimed: list[tuple[HeldRun, dict[str, Any]]]
    sweep_id: int | None
    max_concurrent: int | None


def _claimed_run(job: Job) -> tuple[HeldRun, dict[str, Any]]:
    run = HeldRun(
        job_id=job.id,
        attempt=job.attempt,
        state=JobState.STARTING,
        restarts=job.restarts,
        max_restarts=int(job.spec.get("max_restarts", 0)),
    )
    return run, job.spec


@dataclass(frozen=True)
class WorkerRecords:
    """The database side of one worker: ``worker_id``'s rows and the jobs it holds.

    Every method opens its own session; ``DatabaseUnavailableError`` (and the store's other
    ``DdpqError``s) pass through to the loop, which retries or logs them.
    """

    db: Database
    worker_id: str
    launcher: str
    lease_s: float

    def register(self, *, host: str, pid: int, capacity: dict[str, Any]) -> None:
        """Insert (or revive) this worker's row."""
        with self.db.session() as s:
            workers.register_worker(
                s,
                worker_id=self.worker_id,
                host=host,
                pid=pid,
                launcher=self.launcher,
                capacity=capacity,
            )

    def heartbeat(self) -> list[HeldJob]:
        """Renew this worker's leases (``lease_s`` seconds from now); the jobs it holds.

        Raises:
            NotFoundError: the worker has no row (register again).
        """
        with self.db.session() as s:
            return leases.heartbeat(s, self.worker_id, lease_s=self.lease_s)

    def stop(self) -> None:
        """Mark this worker stopped (its detached jobs become adoptable at once)."""
        with self.db.session() as s:
            workers.stop_worker(s, self.worker_id)

    def claimable(self, max_gpus_per_node: int) -> bool:
        """Whether a job this worker could run is queued (one indexed read, no lock)."""
        with self.db.session(write=False) as s:
            return claims.has_claimable_job(
                s, launcher=self.launcher, max_gpus_per_node=max_gpus_per_node
            )

    def claim(self, max_gpus_per_node: int) -> tuple[HeldRun, dict[str, Any]] | None:
        """Claim the next job (now ``starting``, leased to this worker): its run and its stored
        spec; None when nothing claimable is queued."""
        with self.db.session() as s:
            job = claims.claim_next_job(
                s,
                worker_id=self.worker_id,
                launcher=self.launcher,
                max_gpus_per_node=max_gpus_per_node,
                lease_s=self.lease_s,
            )
            return None if job is None else _claimed_run(job)

    def claim_batch(self, max_gpus_per_node: int, limit: int) -> ClaimedRuns | None:
        """Claim up to ``limit`` queued trials of one sweep (within its ``max_concurrent``),
        or one plain job (``service.store.jobs.batch_claims``); None when nothing is claimable."""
        with self.db.session() as s:
            batch = batch_claims.claim_trial_batch(
                s,
                worker_id=self.worker_id,
                launcher=self.launcher,
                max_gpus_per_node=max_gpus_per_node,
                lease_s=self.lease_s,
                limit=limit,
            )
            if batch is None:
                return None
            runs = [_claimed_run(job) for job in batch.jobs]
            return ClaimedRuns(runs, batch.sweep_id, batch.max_concurrent)

    def mint_token(self, run: HeldRun) -> str:
        """A new attempt token for ``run``'s attempt (stored hashed), for its ranks: valid for
        that attempt's own writes through the attempt API while it is the job's current one.

        Raises:
            ConflictError: the job is gone.
        """
        with self.db.session() as s:
            return attempt_tokens.mint_attempt_token(s, run.job_id, run.attempt)

    def record_handle(self, run: HeldRun, handle: str) -> None:
        """Store a detached launcher's handle as the job's ``scheduler_job_id``."""
        with self.db.session() as s:
            jobs.set_scheduler_job_id(s, run.job_id, run.attempt, handle)

    def record_handles(self, handles: list[tuple[HeldRun, str]]) -> None:
        """``record_handle`` for many runs (an array's elements) in one transaction."""
        with self.db.session() as s:
            for run, handle in handles:
                jobs.set_scheduler_job_id(s, run.job_id, run.attempt, handle)

    def apply(self, decision: Decision) -> JobState:
        """Apply ``decision`` (one compare-and-set with its event); the state it produced (a
        requeue of a job flagged for cancel ends ``cancelled``).

        Raises:
            StaleStateError: the job had moved on.
        """
        with self.db.session() as s:
            job = jobs.apply_transition(
                s,
                decision.transition,
                worker_id=self.worker_id,
                error=decision.error,
                values=dict(decision.values) or None,
            )
            return JobState(job.state)

    def requeue_expired(self) -> list[jobs.Transition]:
        """Requeue (or cancel, if flagged) every job whose lease expired."""
        with self.db.session() as s:
            return leases.requeue_expired_jobs(s)

    def adopter_of(self, run: HeldRun) -> str | None:
        """The other worker that adopted ``run``'s attempt, if any."""
        with self.db.session(write=False) as s:
            return leases.adopter_of(s, run.job_id, run.attempt, self.worker_id)

    def adopt(self) -> list[HeldRun]:
        """Take over the detached jobs of lost or stopped workers; their runs."""
        with self.db.session() as s:
            adopted = leases.adopt_detached_jobs(
                s, worker_id=self.worker_id, launcher=self.launcher, lease_s=self.lease_s
            )
        return [HeldRun.adopted(job) for job in adopted]

    def note(self, run: HeldRun, kind: EventKind, data: Mapping[str, Any]) -> bool:
        """Add a note of ``kind`` with ``data`` to the job's events for ``run``'s attempt (no
        state change); False when the attempt moved on meanwhile (nothing written)."""
        try:
            with self.db.session() as s:
                job_notes.record_job_note(
                    s, run.job_id, run.attempt, kind, data, worker_id=self.worker_id
                )
        except (StaleAttemptError, NotFoundError):
            return False
        return True

    def note_pending_reason(self, job_id: int, attempt: int, code: str, words: str) -> bool:
        """Record the scheduler's pending reason ``code`` for the attempt (unless it is the
        newest one recorded already); False when the attempt moved on meanwhile."""
        try:
            with self.db.session() as s:
                job_notes.record_scheduler_pending(
                    s, job_id, attempt, code, words, worker_id=self.worker_id
                )
        except (StaleAttemptError, NotFoundError):
            return False
        return True
