"""The job resource's values, as its use cases (``service.store.jobs.service``) return them: a
job as shown, a page of jobs, its events, a submission's outcome, a dry run's plan, and why a
job waits (``QueueExplanation``, computed by ``service.store.jobs.queue``). Frozen
dataclasses, never ORM rows: a caller can hold them after the session closed."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from service.core.events import EventKind
from service.core.spec.model import JobSpec


@dataclass(frozen=True, slots=True)
class JobShape:
    """What of a job the explanation needs. ``job_id`` None: a spec not stored yet (a dry
    run or the check at submit), placed behind every queued job of its priority."""

    launcher: str
    gpus_per_node: int
    nproc_per_node: int
    priority: int
    job_id: int | None = None
    cancel_requested: bool = False


@dataclass(frozen=True, slots=True)
class JobAhead:
    """A queued job a worker would claim first. ``owner`` and ``name`` are None unless the
    caller may see that job (their own, or any job for an admin)."""

    id: int
    priority: int
    owner: str | None
    name: str | None


@dataclass(frozen=True, slots=True)
class WorkerFit:
    """One registered (not stopped) worker against the job.

    ``can_ever``: its launcher and capacity (GPUs per node) fit the job, whatever it holds
    now; ``can_now``: also live with a free slot and enough free GPUs. ``why_not`` says why
    not (ever or now); ``notes`` what would go wrong if it ran it (more ranks than cores).
    Counts: slots and GPUs as the worker registered them, ``busy_*`` what its active jobs
    hold; ``cpus`` None when the worker did not say. ``heartbeat_at`` only for a worker that
    is not live (silent or stopped: its last heartbeat, which no longer moves); None for a
    live one. Nothing here depends on the time of the read or of the latest heartbeat (no
    ages), so a polled job's ETag changes only when something did.
    """

    id: str
    host: str
    launcher: str
    live: bool
    stopped: bool
    heartbeat_at: datetime | None
    slots: int
    busy_slots: int
    gpus: int
    busy_gpus: int
    cpus: int | None
    can_ever: bool
    can_now: bool
    why_not: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SchedulerPending:
    """The newest pending reason a worker recorded for an attempt (``job_notes``): Slurm's
    ``code`` (e.g. ``Resources``) and when it was recorded (UTC)."""

    code: str
    recorded_at: datetime


@dataclass(frozen=True, slots=True)
class SchedulerWait:
    """A batch scheduler holding a submitted attempt: Slurm's ``code`` (``squeue -o %r``), in
    plain words (``text``), for its job ``scheduler_job_id``."""

    backend: str
    scheduler_job_id: str | None
    code: str
    text: str


@dataclass(frozen=True, slots=True)
class QueueExplanation:
    """Why a job is not running yet.

    ``position``: 1-based place among the jobs a worker that can run it would claim, None when
    it is not claimable (not queued, or cancel requested); ``ahead_count`` of them are ahead,
    the first ``MAX_AHEAD_SHOWN`` in ``ahead`` (claim order). ``runnable``: some live worker
    could ever run it; ``registered_runnable``: some registered worker (live, silent or
    stopped) could.
    """

    summary: str
    position: int | None = None
    ahead_count: int = 0
    ahead: tuple[JobAhead, ...] = ()
    workers: tuple[WorkerFit, ...] = ()
    runnable: bool = False
    registered_runnable: bool = False
    scheduler: SchedulerWait | None = None


@dataclass(frozen=True, slots=True)
class JobView:
    """A job as the API shows it (attribute names as on the ``jobs`` table). ``spec``,
    ``progress`` and ``latest_metrics`` are the stored JSON as they are (a row stored before a
    check may hold anything); ``queue``: why a job not running yet waits (``describe_job``
    only; None otherwise)."""

    id: int
    name: str
    owner: str
    state: str
    attempt: int
    cancel_requested: bool
    spec: Any
    progress: Any
    latest_metrics: Any
    error: str | None
    scheduler_job_id: str | None
    worker_id: str | None
    priority: int
    launcher: str
    gpus_per_node: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    sweep_id: int | None
    trial_key: str | None
    queue: QueueExplanation | None = None

    @classmethod
    def from_view_row(cls, row: Any, queue: QueueExplanation | None = None) -> JobView:
        """The view of a Core row of ``service.store.jobs.view``'s statement, whose columns
        are this class's fields in order (checked when that module loads): positional, the
        hot path's way (reading 20 attributes of a Row by name cost twice as much)."""
        values: tuple[Any, ...] = (*row, queue)
        return cls(*values)

    @classmethod
    def of(cls, row: Any, queue: QueueExplanation | None = None) -> JobView:
        """The view of ``row``: a ``jobs`` ORM object (or any object with its attributes)."""
        return cls(
            row.id, row.name, row.owner, row.state, row.attempt, bool(row.cancel_requested),
            row.spec, row.progress, row.latest_metrics, row.error, row.scheduler_job_id,
            row.worker_id, row.priority, row.launcher, row.gpus_per_node, row.created_at,
            row.started_at, row.finished_at, row.sweep_id, row.trial_key, queue,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class JobPage:
    """One page of jobs, newest first; ``next_before_id`` continues it (None: the last)."""

    jobs: tuple[JobView, ...]
    next_before_id: int | None


@dataclass(frozen=True, slots=True)
class JobEventView:
    """One ``job_events`` row: a state change (``from_state`` None for the submission), or a
    note (``from_state == to_state``); what happened is ``kind`` with its ``data``
    (``service.core.events``), ``reason`` their wording."""

    id: int
    job_id: int
    attempt: int
    from_state: str | None
    to_state: str
    kind: EventKind
    data: dict[str, Any]
    reason: str | None
    worker_id: str | None
    created_at: datetime

    @classmethod
    def of(cls, row: Any) -> JobEventView:
        """The view of a ``job_events`` ORM object."""
        return cls(
            row.id, row.job_id, row.attempt, row.from_state, row.to_state,
            EventKind(row.kind), dict(row.data or {}), row.reason, row.worker_id,
            row.created_at,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Submitted:
    """What ``POST /jobs`` did: the job, whether it is new (False: a replayed Idempotency-Key
    returned the earlier job), and warnings about a new one (no registered worker could
    ever run it; never a refusal)."""

    job: JobView
    created: bool
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where an existing job's next attempt would start: attempt number ``attempt``, from its
    newest live checkpoint (``step``, 0-based ``epoch``, written by ``checkpoint_attempt``),
    or from step 0 (all three None)."""

    job_id: int
    attempt: int
    step: int | None
    epoch: int | None
    checkpoint_attempt: int | None


@dataclass(frozen=True, slots=True)
class SubmissionPlan:
    """What submitting ``spec`` would do, nothing stored (a dry run): the spec as the submit
    would store it (``init_from`` resolved), the attempt a launch would get, the resume point
    of an existing job planned for, why it would wait and the submit's warnings."""

    spec: JobSpec
    attempt: int
    resume: ResumePoint | None
    queue: QueueExplanation
    warnings: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LogChunk:
    """A slice of one rank's log: ``text`` (UTF-8, bad bytes as U+FFFD) up to byte
    ``next_offset`` (ask again from there), of ``rank`` in ``attempt``; ``eof`` when the
    slice reached the current end of the file; ``found`` False when this host holds no such
    file (the rank has not started, or its worker's artifact dir is not this one)."""

    text: str
    next_offset: int
    rank: int
    attempt: int
    eof: bool
    found: bool = True
