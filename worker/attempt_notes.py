"""What a worker tells people about an attempt beyond its state, as job events: a CPU job
with more ranks than the worker has cores, the batch scheduler's reason for keeping a
submitted attempt pending (asked for all pending attempts at once, recorded when it changes),
and what a launcher noted about an ended attempt (``RunStatus.notes``: a log cut at its cap).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from service.core.pending_reasons import describe_slurm_reason
from service.core.spec.model import JobSpec
from worker.control.records import WorkerRecords
from worker.decisions import HeldRun
from worker.launchers.base import Launcher, PendingExplainer, RunPhase, RunStatus

log = logging.getLogger(__name__)

# Seconds between two pending-reason queries (one squeue for all pending attempts).
PENDING_REASON_POLL_S = 5.0


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity mask), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def oversubscription_note(spec: JobSpec, cpus: int) -> dict[str, int] | None:
    """The data of the ``more_ranks_than_cores`` note (``service.core.events`` words it) for
    a CPU job whose ``nproc_per_node`` ranks outnumber the ``cpus`` cores of the worker's
    host, else None. The ranks still run (torchrun starts them all), but they share cores,
    and the global batch (ranks × batch_size) is what the spec says — a run sized for fewer
    cores would see another batch, learning dynamics and accuracy."""
    r = spec.resources
    if r.gpus_per_node or r.nproc_per_node <= cpus:
        return None
    note = {"nproc_per_node": r.nproc_per_node, "cpus": cpus}
    if not spec.is_command:  # a script's batch size is its own, not the spec's
        note["batch_size"] = spec.training.batch_size
    return note


@dataclass
class PendingReasons:
    """The pending reasons recorded so far per job (the loop records only changes) and when
    the backend may be asked next (monotonic seconds)."""

    poll_s: float = PENDING_REASON_POLL_S
    recorded: dict[int, tuple[int, str]] = field(default_factory=dict)  # job → (attempt, code)
    next_poll_mono: float = 0.0

    def due(self) -> bool:
        """Whether it is time to ask the backend again (and, if so, the clock restarts)."""
        now = time.monotonic()
        if now < self.next_poll_mono:
            return False
        self.next_poll_mono = now + self.poll_s
        return True

    def changed(
        self, pending: Mapping[int, tuple[int, str]], reasons: Mapping[str, str]
    ) -> list[tuple[int, int, str]]:
        """``(job_id, attempt, code)`` for each pending attempt whose reason differs from the
        one recorded. ``pending``: job → (attempt, handle); ``reasons``: handle → code. Jobs
        no longer pending are forgotten."""
        for job_id in set(self.recorded) - set(pending):
            del self.recorded[job_id]
        out = []
        for job_id, (attempt, handle) in pending.items():
            code = reasons.get(handle)
            if code is not None and self.recorded.get(job_id) != (attempt, code):
                out.append((job_id, attempt, code))
        return out

    def remember(self, job_id: int, attempt: int, code: str) -> None:
        """``code`` is now recorded for the job's ``attempt``."""
        self.recorded[job_id] = (attempt, code)

    def record_changes(
        self,
        launcher: Launcher,
        records: WorkerRecords,
        runs: list[HeldRun],
        statuses: Mapping[str, RunStatus],
    ) -> None:
        """Record why the backend keeps submitted attempts pending, as job events when a
        reason changes: one query for all of ``runs`` whose polled status is PENDING (Slurm:
        one squeue), at most every ``poll_s`` seconds; nothing for a launcher that cannot
        say (not a ``PendingExplainer``)."""
        if not isinstance(launcher, PendingExplainer):
            return
        pending = {
            r.job_id: (r.attempt, r.handle)
            for r in runs
            if r.handle is not None
            and r.handle in statuses
            and statuses[r.handle].phase == RunPhase.PENDING
        }
        if not pending or not self.due():
            return
        reasons = launcher.pending_reasons(sorted({h for _, h in pending.values()}))
        for job_id, attempt, code in self.changed(pending, reasons):
            if records.note_pending_reason(job_id, attempt, code, describe_slurm_reason(code)):
                self.remember(job_id, attempt, code)


def post_status_notes(records: WorkerRecords, run: HeldRun, status: RunStatus) -> None:
    """Post ``status.notes`` as the attempt's job events, once per run (before its outcome
    is applied: a note of an ended attempt's holder is refused). A note the API refuses or
    cannot take now is logged and not retried: the outcome matters more."""
    if run.notes_posted or not status.notes:
        return
    run.notes_posted = True
    for kind, data in status.notes:
        try:
            records.note(run.job_id, run.attempt, kind, data)
        except Exception as exc:
            log.warning("job_id=%d: %s note not recorded: %s", run.job_id, kind, exc)
