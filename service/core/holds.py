"""What passes between a worker and the store about the jobs it holds, as plain values: a
planned state change, a claimed job, a heartbeat's view of a held job, an adopted detached
job, a launcher handle to record.

These are the worker interface's wire shapes (``worker.control.records.WorkerRecords``): no ORM row,
no session, nothing a JSON body could not carry. ``worker.decisions`` plans with them and
``service.store`` applies them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from service.core.events import EventKind, render
from service.core.states import JobState

# The reason of a cancel a worker carried out.
CANCEL_REQUESTED_REASON = render(EventKind.CANCELLED)  # "cancel requested"


@dataclass(frozen=True, slots=True)
class Transition:
    """A planned state change ``expected → target`` of job ``job_id``: printable, testable,
    applied as one compare-and-set (``service.store.jobs.crud.apply_transition``).

    ``kind`` and ``data`` are its event's (``service.core.events``), ``reason`` their
    wording (``Transition.of`` renders it); a transition planned with a ``reason`` only is
    written as a ``state_changed`` event carrying that text.
    """

    job_id: int
    expected: JobState
    target: JobState
    reason: str | None = None
    # Not compared: two transitions are equal when they change the same job alike and say so
    # in the same words (a test may plan one with its text alone).
    kind: EventKind | None = field(default=None, compare=False)
    data: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def of(
        cls,
        job_id: int,
        expected: JobState,
        target: JobState,
        kind: EventKind,
        data: Mapping[str, Any] | None = None,
    ) -> Transition:
        """The transition whose event is ``kind`` with ``data``, its reason rendered.

        Raises:
            KeyError: ``data`` lacks a field the kind's wording needs.
        """
        return cls(job_id, expected, target, render(kind, data), kind, dict(data or {}))

    def event(self) -> tuple[EventKind, Mapping[str, Any]]:
        """The kind and data its event is written with."""
        if self.kind is not None:
            return self.kind, self.data
        return EventKind.STATE_CHANGED, {"reason": self.reason} if self.reason else {}


@dataclass(frozen=True, slots=True)
class HeldJob:
    """What a heartbeat tells a worker about one job it holds: its current ``attempt``,
    ``state`` (a ``JobState`` value) and whether a cancel was requested."""

    job_id: int
    attempt: int
    state: str
    cancel_requested: bool


@dataclass(frozen=True, slots=True)
class ClaimedJob:
    """A job a worker just claimed (now ``starting``, leased to it): its attempt, the
    relaunches after failures so far and allowed (``max_restarts`` from the spec), the
    stored spec (a JSON object; ``JobSpec.model_validate`` it), the attempt token minted
    for its ranks in the claim's transaction (empty from a claim that mints none) and the
    job's ``owner`` (whose Unix user runs its ranks, ``service.core.owners.rank_users``; None from
    an API that sends none)."""

    job_id: int
    attempt: int
    restarts: int
    max_restarts: int
    spec: dict[str, Any] = field(hash=False)
    attempt_token: str = field(default="", repr=False, compare=False)
    owner: str | None = None


@dataclass(frozen=True, slots=True)
class ClaimedJobs:
    """What one claim took: ``jobs`` (best first, never empty), all trials of sweep
    ``sweep_id`` (a batch claim), or jobs of any kinds (``sweep_id`` None: one claim for a
    worker's free slots); ``max_concurrent`` is that sweep's limit (None: no limit), which a
    launcher passes on (Slurm's array parallelism)."""

    jobs: tuple[ClaimedJob, ...]
    sweep_id: int | None
    max_concurrent: int | None


@dataclass(frozen=True, slots=True)
class AdoptedJob:
    """A detached job a worker now holds; poll it with ``scheduler_job_id`` as the handle."""

    job_id: int
    attempt: int
    state: JobState
    scheduler_job_id: str
    cancel_requested: bool
    previous_worker_id: str | None
    restarts: int = 0  # relaunches after failures so far
    max_restarts: int = 0  # from the spec


@dataclass(frozen=True, slots=True)
class SchedulerHandle:
    """A detached launcher's handle for attempt ``attempt`` of job ``job_id`` (Slurm's job
    id), recorded as the job's ``scheduler_job_id`` so any worker can adopt and follow it."""

    job_id: int
    attempt: int
    scheduler_job_id: str
