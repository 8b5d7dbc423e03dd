"""API models of why a job waits (the Job's ``queue``) and of a dry run's answer (``POST
/jobs?dry_run=true``)."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from service.store.jobs.values import QueueExplanation


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class JobAheadOut(_Out):
    """A queued job that a worker would claim before this one."""

    id: int
    priority: int
    owner: str | None = Field(
        description="Null unless the caller may see this job (their own; an admin sees all)."
    )
    name: str | None = Field(description="Null unless the caller may see this job.")


class WorkerFitOut(_Out):
    """One registered worker against the job: could it ever run it, could it now, why not."""

    id: str
    host: str
    launcher: str
    live: bool = Field(description="Heartbeat fresh and not stopped.")
    heartbeat_at: datetime | None = Field(
        description="The last heartbeat of a worker that is not live (silent or stopped); null "
        "for a live one, so the job's ETag does not change with every heartbeat."
    )
    slots: int
    busy_slots: int
    gpus: int
    busy_gpus: int
    cpus: int | None = Field(description="CPU cores the worker may use; null if not reported.")
    can_ever: bool = Field(description="Its launcher and GPUs fit the job, whatever it holds.")
    can_now: bool = Field(description="Also live, with a free slot and enough free GPUs.")
    why_not: list[str] = Field(description="Why it cannot run the job (ever, or now).")
    notes: list[str] = Field(description="What would go wrong if it ran it (e.g. more ranks "
                             "than cores).")  # fmt: skip


class SchedulerWaitOut(_Out):
    """A batch scheduler holding the job's submitted attempt."""

    backend: str = Field(description="e.g. 'Slurm'.")
    scheduler_job_id: str | None
    code: str = Field(description="The scheduler's own reason, e.g. Slurm's 'Resources'.")
    text: str = Field(description="The reason in plain words.")


class QueueOut(_Out):
    """Why a job is not running yet (GET /jobs/{id} and dry runs; null otherwise)."""

    summary: str = Field(description="The same line as ``queue_reason``.")
    position: int | None = Field(
        description="1-based place among the jobs a worker able to run it would claim "
        "(claim order: priority, then age); null when it is not claimable."
    )
    ahead_count: int = Field(description="Claimable jobs ahead of it.")
    ahead: list[JobAheadOut] = Field(description="The first of them, in claim order.")
    workers: list[WorkerFitOut] = Field(description="Registered (not stopped) workers.")
    runnable: bool = Field(description="Some live worker could ever run it.")
    scheduler: SchedulerWaitOut | None = Field(
        description="Set while a batch scheduler (Slurm) holds the submitted attempt."
    )


def queue_out(explanation: QueueExplanation) -> QueueOut:
    """A ``QueueExplanation`` as the API shows it."""
    wait = explanation.scheduler
    return QueueOut(
        summary=explanation.summary,
        position=explanation.position,
        ahead_count=explanation.ahead_count,
        ahead=[JobAheadOut(**dataclasses.asdict(a)) for a in explanation.ahead],
        workers=[
            WorkerFitOut(
                **{k: v for k, v in dataclasses.asdict(w).items() if k in WorkerFitOut.model_fields}
            )
            for w in explanation.workers
        ],
        runnable=explanation.runnable,
        scheduler=SchedulerWaitOut(**dataclasses.asdict(wait)) if wait is not None else None,
    )


class PlanOut(_Out):
    """The launch plan one launcher would run (rendered by the launcher's own ``plan``)."""

    launcher: str
    text: str = Field(description="The plan as the worker logs it: environment (secrets "
                      "masked), files written, command line, sbatch script.")  # fmt: skip
    argv: list[str] = Field(description="The command line (torchrun's, or ['sbatch']).")
    env_names: list[str] = Field(description="Environment the ranks get beyond what they "
                                 "inherit, names only.")  # fmt: skip
    script: str | None = Field(description="The rendered sbatch script (Slurm), else null.")
    files: list[str] = Field(description="Files written into the attempt directory first.")
    error: str | None = Field(description="Why this launcher cannot plan the spec, if so.")


class ResumeOut(_Out):
    """Where an existing job's next attempt would start from."""

    job_id: int
    attempt: int = Field(description="The attempt number the next launch would get.")
    step: int | None = Field(description="The newest live checkpoint's step; null: step 0.")
    epoch: int | None = Field(description="Its epoch, 0-based.")
    checkpoint_attempt: int | None = Field(description="The attempt that wrote it.")
    note: str


class InitStartOut(_Out):
    """The checkpoint ``init_from`` resolved to, as the real submit would store it."""

    job: int = Field(description="The source job.")
    step: int = Field(description="The step of its committed checkpoint.")
    sha256: str = Field(description="That checkpoint file's sha256.")
    mode: str = Field(description="weights_only | full.")


class DryRunOut(_Out):
    """What submitting the spec would do; nothing was stored."""

    dry_run: bool = True
    spec: dict[str, Any] = Field(description="The spec as it would be stored (defaults filled).")
    job_id: int | None = Field(description="The existing job planned for (``job_id``), if any.")
    attempt: int
    plans: list[PlanOut]
    resume: ResumeOut | None
    queue: QueueOut
    warnings: list[str]
    init_from: InitStartOut | None = Field(
        default=None, description="Where init_from starts (resolved as the submit would)."
    )
