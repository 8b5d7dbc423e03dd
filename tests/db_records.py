"""``DatabaseRecords``: the worker's records (``worker.control.records.WorkerRecords``, our own
interface) straight on the database, for tests that drive a ``WorkerLoop`` in this process.
Production workers use ``worker.api_client.ApiRecords`` over the worker API."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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
from service.store.db import Database
from service.store.jobs import service as jobs
from service.store.workers import service as workers


@dataclass(frozen=True)
class DatabaseRecords:
    """``WorkerRecords`` straight on the database, for tests that drive a ``WorkerLoop`` in
    this process with a scripted launcher: worker ``worker_id`` of ``launcher``, whose leases
    last ``lease_s`` seconds. Each method is the use case the worker API's route for it calls
    (``service.store.workers.service``), so the loop meets the same fences as over HTTP;
    ``requeue_expired`` is the API reaper's step, for tests that play the reaper."""

    db: Database
    worker_id: str
    launcher: str
    lease_s: float
    call_timeout_s: float = 0.0

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

    def claim(self, max_gpus_per_node: int, wait_s: float = 0.0) -> ClaimedJob | None:
        """See ``WorkerRecords.claim`` (waits by polling every 0.05 s)."""
        got = self.claim_batch(max_gpus_per_node, 1, wait_s, batch=False)
        return got.jobs[0] if got is not None else None

    def claim_many(
        self, max_gpus_per_node: int, limit: int, wait_s: float = 0.0
    ) -> list[ClaimedJob]:
        """See ``WorkerRecords.claim_many``."""
        got = self.claim_batch(max_gpus_per_node, limit, wait_s, batch=False)
        return list(got.jobs) if got is not None else []

    def claim_batch(
        self, max_gpus_per_node: int, limit: int, wait_s: float = 0.0, *, batch: bool = True
    ) -> ClaimedJobs | None:
        """See ``WorkerRecords.claim_batch`` (``batch`` False: ``claim_many``'s jobs)."""
        deadline = time.monotonic() + wait_s
        while True:
            got = workers.claim_for_worker(
                self.db, worker_id=self.worker_id, launcher=self.launcher,
                max_gpus_per_node=max_gpus_per_node, lease_s=self.lease_s,
                batch_limit=limit if batch else None, limit=1 if batch else limit,
            )  # fmt: skip
            if got is not None or time.monotonic() >= deadline:
                return got
            time.sleep(0.05)

    def record_handles(self, handles: Sequence[SchedulerHandle]) -> None:
        """See ``WorkerRecords.record_handles``."""
        workers.record_held_handles(self.db, handles, worker_id=self.worker_id)

    def apply(
        self,
        transition: Transition,
        *,
        error: str | None = None,
        values: Mapping[str, Any] | None = None,
    ) -> JobState:
        """See ``WorkerRecords.apply``."""
        return workers.apply_held_transition(
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
