"""What a worker reads and writes about itself and the jobs it holds: one typed interface,
``WorkerRecords``.

``WorkerLoop`` decides; every control-plane call it makes goes through ``WorkerRecords``
(register, heartbeat, claim with the attempt tokens for the ranks, record detached handles,
apply a transition, adopt, note, stop). Plain values in and out (``service.core.holds``,
``JobState``, ``EventKind`` with its data): nothing a JSON body could not carry. The worker's
implementation is ``worker.api_client.ApiRecords``, over the worker API with a worker token;
the worker holds no database URL. Requeueing the jobs of lost workers is the API's reaper's
(the API's reaper), not a worker's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


class WorkerRecords(Protocol):
    """The control plane as one worker sees it: its own row and the jobs it holds.

    Every call is one transaction on the other side. ``ControlPlaneUnavailableError`` (the
    API or its database cannot be reached), ``WorkerTokenRefusedError`` and the other
    ``DdpqError``s named below pass through to the loop, which retries or logs them.
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

    @property
    def lease_s(self) -> float:
        """How long a lease lasts from the call that renewed it (seconds), as the control
        plane grants it: the worker must stop a job's ranks before a lease it could not renew
        runs out."""
        ...

    @property
    def call_timeout_s(self) -> float:
        """The longest one call may block before it fails (seconds; a claim's own wait
        aside): the lease fence counts it in its budget."""
        ...

    def claim(self, max_gpus_per_node: int, wait_s: float = 0.0) -> ClaimedJob | None:
        """Claim the next job (now ``starting``, leased to this worker, with the attempt
        token for its ranks); with nothing claimable wait up to ``wait_s`` seconds for one (a
        long poll); None when none came."""
        ...

    def claim_many(
        self, max_gpus_per_node: int, limit: int, wait_s: float = 0.0
    ) -> list[ClaimedJob]:
        """Claim up to ``limit`` of the next jobs (each needing at most ``max_gpus_per_node``
        GPUs per node; a worker with that many free slots), each as ``claim``'s, best first;
        waits like ``claim`` but answers with what it found, never waiting for more; empty
        when none came."""
        ...

    def claim_batch(
        self, max_gpus_per_node: int, limit: int, wait_s: float = 0.0
    ) -> ClaimedJobs | None:
        """Claim up to ``limit`` queued trials of one sweep (within its ``max_concurrent``),
        or one plain job, each with its attempt token; waits like ``claim``; None when
        nothing is claimable."""
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
