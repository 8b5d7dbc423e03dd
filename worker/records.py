"""What a worker reads and writes about itself and the jobs it holds: one typed interface,
``WorkerRecords``, and its database implementation, ``DatabaseRecords``.

``WorkerLoop`` decides; every store call it makes goes through ``WorkerRecords`` (register,
heartbeat, claim, mint an attempt's token, record detached handles, apply a transition, reap,
adopt, note, stop). Plain values in and out (``service.core.holds``, ``JobState``,
``EventKind`` with its data): no ORM row, no session, nothing a JSON body could not carry,
so the same interface can be served over HTTP (the worker API) as well as by
``DatabaseRecords``, which calls the store's use cases (``service.store.workers.service``,
``service.store.jobs.service``, ``service.store.attempts.service``) and opens no session
itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from service.core.events import EventKind
from service.core.holds import (
    AdoptedJob,
    ClaimedJob,
    ClaimedJobs,
    HeldJob,
    SchedulerHandle,
    Transition,
)
from service.core.states import JobState
from service.store.attempts import service as attempts
from service.store.db import Database
from service.store.jobs import service as jobs
from service.store.workers import service as workers


class WorkerRecords(Protocol):
    """The control plane as one worker sees it: its own row and the jobs it holds.

    Every call is one transaction on the other side. ``DatabaseUnavailableError`` (and the
    other ``DdpqError``s named below) pass through to the loop, which retries or logs them.
    """

    @property
    def worker_id(self) -> str:
        """The worker these records speak for."""
        ...

    def register(self, *, host: str, pid: int, capacity: dict[str, Any]) -> None:
        """Insert (or revive) this worker's row; ``capacity``: ``{"slots": int, "gpus":
        [int], "cpus": int}``."""
        ...

    def heartbeat(self) -> list[HeldJob]:
        """Renew this worker's leases; the jobs it holds.

        Raises:
            NotFoundError: the worker has no row (register again).
        """
        ...

    def stop(self) -> None:
        """Mark this worker stopped (its detached jobs become adoptable at once)."""
        ...

    def claimable(self, max_gpus_per_node: int) -> bool:
        """Whether a job this worker could run is queued (a cheap read, no lock)."""
        ...

    def claim(self, max_gpus_per_node: int) -> ClaimedJob | None:
        """Claim the next job (now ``starting``, leased to this worker); None when nothing
        claimable is queued."""
        ...

    def claim_batch(self, max_gpus_per_node: int, limit: int) -> ClaimedJobs | None:
        """Claim up to ``limit`` queued trials of one sweep (within its ``max_concurrent``),
        or one plain job; None when nothing is claimable."""
        ...

    def mint_token(self, job_id: int, attempt: int) -> str:
        """A new attempt token for the ranks of ``attempt`` of the job: valid for that
        attempt's own writes through the attempt API while it is the job's current one.

        Raises:
            ConflictError: the job is gone.
        """
        ...

    def record_handles(self, handles: Sequence[SchedulerHandle]) -> None:
        """Store detached launchers' handles as their jobs' ``scheduler_job_id`` (each fenced
        on its attempt), all at once."""
        ...

    def apply(
        self,
        transition: Transition,
        *,
        error: str | None = None,
        values: Mapping[str, Any] | None = None,
    ) -> JobState:
        """Apply ``transition`` (one compare-and-set with its event; ``error``: the job's
        error text, ``values``: side columns such as ``restarts``); the state it produced
        (a requeue of a job flagged for cancel ends ``cancelled``).

        Raises:
            StaleStateError: the job had moved on.
        """
        ...

    def requeue_expired(self) -> list[Transition]:
        """Requeue (or cancel, if flagged) every job whose lease expired; what was applied."""
        ...

    def adopter_of(self, job_id: int, attempt: int) -> str | None:
        """The other worker that adopted ``attempt`` of the job and still holds it, if any."""
        ...

    def adopt(self) -> list[AdoptedJob]:
        """Take over the detached jobs of lost or stopped workers of this launcher."""
        ...

    def note(self, job_id: int, attempt: int, kind: EventKind, data: Mapping[str, Any]) -> bool:
        """Add a note of ``kind`` with ``data`` (``service.core.events``) to the job's events
        for ``attempt`` (no state change); False when the attempt moved on meanwhile
        (nothing written)."""
        ...

    def note_pending_reason(self, job_id: int, attempt: int, code: str, words: str) -> bool:
        """Record the batch scheduler's pending reason ``code`` (in plain ``words``) for the
        attempt unless it is the newest one recorded already; False when the attempt moved
        on meanwhile."""
        ...


@dataclass(frozen=True)
class DatabaseRecords:
    """``WorkerRecords`` on the database: worker ``worker_id`` of ``launcher``, whose leases
    last ``lease_s`` seconds from each heartbeat or claim. Each method is one use case of
    ``service.store`` (which opens its session)."""

    db: Database
    worker_id: str
    launcher: str
    lease_s: float

    def register(self, *, host: str, pid: int, capacity: dict[str, Any]) -> None:
        """See ``WorkerRecords.register``."""
        workers.register_worker(
            self.db,
            worker_id=self.worker_id,
            host=host,
            pid=pid,
            launcher=self.launcher,
            capacity=capacity,
        )

    def heartbeat(self) -> list[HeldJob]:
        """See ``WorkerRecords.heartbeat``."""
        return workers.record_heartbeat(self.db, self.worker_id, lease_s=self.lease_s)

    def stop(self) -> None:
        """See ``WorkerRecords.stop``."""
        workers.stop_worker(self.db, self.worker_id)

    def claimable(self, max_gpus_per_node: int) -> bool:
        """See ``WorkerRecords.claimable``."""
        return jobs.has_claimable_job(
            self.db, launcher=self.launcher, max_gpus_per_node=max_gpus_per_node
        )

    def claim(self, max_gpus_per_node: int) -> ClaimedJob | None:
        """See ``WorkerRecords.claim``."""
        return jobs.claim_next_job(
            self.db,
            worker_id=self.worker_id,
            launcher=self.launcher,
            max_gpus_per_node=max_gpus_per_node,
            lease_s=self.lease_s,
        )

    def claim_batch(self, max_gpus_per_node: int, limit: int) -> ClaimedJobs | None:
        """See ``WorkerRecords.claim_batch``."""
        return jobs.claim_job_batch(
            self.db,
            worker_id=self.worker_id,
            launcher=self.launcher,
            max_gpus_per_node=max_gpus_per_node,
            lease_s=self.lease_s,
            limit=limit,
        )

    def mint_token(self, job_id: int, attempt: int) -> str:
        """See ``WorkerRecords.mint_token``."""
        return attempts.mint_token(self.db, job_id, attempt)

    def record_handles(self, handles: Sequence[SchedulerHandle]) -> None:
        """See ``WorkerRecords.record_handles``."""
        jobs.record_scheduler_job_ids(self.db, handles)

    def apply(
        self,
        transition: Transition,
        *,
        error: str | None = None,
        values: Mapping[str, Any] | None = None,
    ) -> JobState:
        """See ``WorkerRecords.apply``."""
        return jobs.apply_transition(
            self.db, transition, worker_id=self.worker_id, error=error, values=values
        )

    def requeue_expired(self) -> list[Transition]:
        """See ``WorkerRecords.requeue_expired``."""
        return workers.requeue_expired_jobs(self.db)

    def adopter_of(self, job_id: int, attempt: int) -> str | None:
        """See ``WorkerRecords.adopter_of``."""
        return workers.find_adopter(self.db, job_id, attempt, worker_id=self.worker_id)

    def adopt(self) -> list[AdoptedJob]:
        """See ``WorkerRecords.adopt``."""
        return workers.adopt_detached_jobs(
            self.db, worker_id=self.worker_id, launcher=self.launcher, lease_s=self.lease_s
        )

    def note(self, job_id: int, attempt: int, kind: EventKind, data: Mapping[str, Any]) -> bool:
        """See ``WorkerRecords.note``."""
        return jobs.note_job(self.db, job_id, attempt, kind, data, worker_id=self.worker_id)

    def note_pending_reason(self, job_id: int, attempt: int, code: str, words: str) -> bool:
        """See ``WorkerRecords.note_pending_reason``."""
        return jobs.note_scheduler_pending(
            self.db, job_id, attempt, code, words, worker_id=self.worker_id
        )
