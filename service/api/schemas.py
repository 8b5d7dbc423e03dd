"""API request and response models (separate from the tables; see DESIGN.md "REST API")."""

from __future__ import annotations

import logging
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticSerializationError

from service.api.queue_schemas import QueueOut, queue_out
from service.core.artifacts import artifact_relative_path
from service.core.events import EventKind, describe_kinds
from service.core.metrics.main_metric import main_metric_name
from service.core.metrics.points import JsonNumber, json_safe
from service.core.spec.model import JobSpec
from service.core.spec.text import display_text
from service.store.checkpoints.values import CheckpointInfo
from service.store.jobs.values import JobEventView, JobView, QueueExplanation
from service.store.workers.values import WorkerView

log = logging.getLogger(__name__)

# ---- output models ---------------------------------------------------------------------


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


EPOCH_DESCRIPTION = (
    "The epoch in progress, 0-based as in code (the first epoch is 0); epoch_number is the "
    "same epoch counted from 1."
)
EPOCH_NUMBER_DESCRIPTION = (
    "The epoch in progress counted from 1 (epoch + 1): the number the CLI and the dashboard "
    "show, e.g. 'epoch 3' is epoch_number 3, epoch 2."
)


class ProgressOut(_Out):
    """Rank 0's latest progress snapshot of a job. Epochs come twice, so nobody has to guess:
    ``epoch`` 0-based (as in code and in metric points), ``epoch_number`` 1-based (as shown)."""

    step: int | None = Field(default=None, description="Global optimizer step (1-based).")
    total_steps: int | None = None
    epoch: int | None = Field(default=None, description=EPOCH_DESCRIPTION)
    epoch_number: int | None = Field(default=None, description=EPOCH_NUMBER_DESCRIPTION)
    samples_per_s: JsonNumber = None
    eta_s: JsonNumber = Field(default=None, description="Seconds left (estimate).")


class JobOut(_Out):
    """A job as the API shows it."""

    id: int
    name: str
    owner: str
    state: str
    attempt: int
    cancel_requested: bool
    spec: dict[str, Any]
    progress: ProgressOut | None
    latest_metrics: dict[str, JsonNumber] = Field(description="Newest value of each metric.")
    main_metric: str = Field(
        description="The metric that sums the job up for its task (eval_accuracy for digits, "
        "else loss); see service.core.metrics.main_metric."
    )
    main_metric_value: JsonNumber = Field(
        default=None, description="Newest value of ``main_metric``; null until reported."
    )
    error: str | None
    scheduler_job_id: str | None
    worker_id: str | None
    priority: int
    launcher: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    sweep_id: int | None = Field(default=None, description="The sweep this job is a trial of.")
    trial_key: str | None = Field(
        default=None, description="Its trial's key (sha256 of the trial's overrides)."
    )
    queue_reason: str | None = Field(
        default=None,
        description="Why a queued job waits, or why Slurm holds a submitted one (GET "
        "/jobs/{id} only; null otherwise), e.g. 'no live worker for launcher local'.",
    )
    queue: QueueOut | None = Field(
        default=None,
        description="``queue_reason`` in detail: place in the queue, jobs ahead, which "
        "workers could run it and why not, the scheduler's reason (GET /jobs/{id} only).",
    )


class SubmittedJobOut(JobOut):
    """POST /jobs's answer: the job, plus warnings about it (never a refusal)."""

    warnings: list[str] = Field(
        default_factory=list,
        description="e.g. no registered worker could ever run this spec (workers come and go, "
        "so it is queued all the same).",
    )


class JobListOut(_Out):
    """One page of jobs, newest first; pass ``next_cursor`` as ``cursor`` for the next."""

    jobs: list[JobOut]
    next_cursor: str | None


class EventOut(_Out):
    """One state change of a job, or a note about it (``from_state == to_state``)."""

    id: int
    attempt: int
    from_state: str | None
    to_state: str
    kind: EventKind = Field(
        description="What happened; branch on this (and data), never on reason. Each kind "
        "with the fields of its data (?: optional):\n" + describe_kinds()
    )
    data: dict[str, Any] = Field(
        description='The kind\'s details (see kind), e.g. {"step": 40, "keep": 2} for '
        "checkpoint_deleted; {} for a kind without any."
    )
    reason: str | None = Field(
        description="kind and data in words, for people (null for submitted)."
    )
    worker_id: str | None
    created_at: datetime


class EventListOut(_Out):
    """A job's state history, oldest first."""

    events: list[EventOut]


class CheckpointOut(_Out):
    """A checkpoint file recorded by rank 0."""

    step: int
    epoch: int = Field(description="0-based, as in code (the first epoch is 0).")
    epoch_number: int = Field(description="1-based (epoch + 1): the number the CLI and the "
                              "dashboard show.")  # fmt: skip
    attempt: int
    size_bytes: int
    sha256: str
    created_at: datetime
    path: str | None = Field(
        default=None,
        description="File path relative to the server's artifact directory "
        "(jobs/<id>/checkpoints/step-<step>.pt); null if recorded outside it.",
    )
    store: str = Field(
        default="filesystem", description="Where the bytes are: 'filesystem' or 'database'."
    )
    file_name: str | None = Field(
        default=None,
        description="A followed checkpoint's file in the command job's workspace (its "
        "checkpoints.path, e.g. 'snapshot.pt'), put back there before the next attempt; null "
        "for a checkpoint ddpq wrote itself.",
    )


class CheckpointListOut(_Out):
    """A job's live checkpoints, newest step first."""

    checkpoints: list[CheckpointOut]


class LogsOut(_Out):
    """A slice of one rank's log; ask again from ``next_offset`` (bytes) for more."""

    text: str
    next_offset: int = Field(description="Byte offset to pass as ``offset`` next time.")
    rank: int
    attempt: int
    eof: bool = Field(description="True when this slice reached the current end of the file.")
    found: bool = Field(
        description="False when the API's host holds no such log: the rank has not started, "
        "or it ran on a worker whose artifact dir is not shared with the API (a rank's log "
        "stays on its worker's host)."
    )


class WorkerOut(_Out):
    """A worker and the active jobs it holds."""

    id: str
    host: str
    pid: int
    launcher: str
    capacity: dict[str, Any]
    started_at: datetime
    heartbeat_at: datetime
    stopped_at: datetime | None
    heartbeat_age_s: float = Field(description="Seconds since the last heartbeat.")
    status: Literal["live", "lost", "stopped"] = Field(
        description="live; lost (no heartbeat for 3 heartbeat intervals: not counted as a "
        "worker that could run a job); stopped (shut down cleanly)."
    )
    running_jobs: list[int]


class WorkerListOut(_Out):
    """Every known worker, newest heartbeat first."""

    workers: list[WorkerOut]


class HealthOut(_Out):
    """Liveness / readiness answer."""

    status: str


# ---- conversions -----------------------------------------------------------------------


def _number(value: Any) -> JsonNumber:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value if isinstance(value, str) else None
    return json_safe(float(value))


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return int(value)
    return None


def progress_out(progress: dict[str, Any] | None) -> ProgressOut | None:
    """The stored progress dict as a JSON-safe ProgressOut (unknown keys dropped)."""
    if not progress:
        return None
    epoch = _int_or_none(progress.get("epoch"))
    return ProgressOut(
        step=_int_or_none(progress.get("step")),
        total_steps=_int_or_none(progress.get("total_steps")),
        epoch=epoch,
        epoch_number=epoch + 1 if epoch is not None else None,
        samples_per_s=_number(progress.get("samples_per_s")),
        eta_s=_number(progress.get("eta_s")),
    )


def _escaped(value: Any) -> Any:
    """``value`` with every string (keys too) through ``display_text``: JSON-encodable."""
    if isinstance(value, str):
        return display_text(value)
    if isinstance(value, dict):
        return {_escaped(k): _escaped(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_escaped(v) for v in value]
    return value


def dump_json(model: BaseModel) -> bytes:
    """``model`` as JSON bytes. A row stored before the spec checks could hold text JSON
    cannot carry (lone surrogates); then every string is escaped (as ``\\udXXX``) and served
    all the same, so one bad row never turns a list into a 500."""
    try:
        return model.model_dump_json().encode()
    except PydanticSerializationError as exc:
        log.warning("%s holds text JSON cannot carry (%s); serving it escaped", type(model), exc)
        return type(model).model_validate(_escaped(model.model_dump())).model_dump_json().encode()


def job_out(
    job: JobView,
    queue_reason: str | None = None,
    *,
    queue: QueueExplanation | None = None,
) -> JobOut:
    """A job as the API's Job (``latest_metrics`` flattened to ``{name: value}``, by name).
    With ``queue`` (e.g. ``job.queue``), ``queue_reason`` is its summary."""
    latest: dict[str, JsonNumber] = {}
    metrics = job.latest_metrics if isinstance(job.latest_metrics, dict) else {}
    for name, entry in sorted(metrics.items()):  # one order on both databases
        latest[str(name)] = _number(entry.get("value") if isinstance(entry, dict) else entry)
    spec = job.spec if isinstance(job.spec, dict) else {}
    main = main_metric_name(str(spec.get("task", "")))
    return JobOut(
        id=job.id,
        name=job.name,
        owner=job.owner,
        state=job.state,
        attempt=job.attempt,
        cancel_requested=bool(job.cancel_requested),
        spec=spec,
        progress=progress_out(job.progress if isinstance(job.progress, dict) else None),
        latest_metrics=latest,
        main_metric=main,
        main_metric_value=latest.get(main),
        error=job.error,
        scheduler_job_id=job.scheduler_job_id,
        worker_id=job.worker_id,
        priority=job.priority,
        launcher=job.launcher,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        sweep_id=job.sweep_id,
        trial_key=job.trial_key,
        queue_reason=queue.summary if queue is not None else queue_reason,
        queue=queue_out(queue) if queue is not None else None,
    )


def event_out(event: JobEventView) -> EventOut:
    """A job's event as the API shows it."""
    return EventOut(
        id=event.id,
        attempt=event.attempt,
        from_state=event.from_state,
        to_state=event.to_state,
        kind=event.kind,
        data=event.data,
        reason=event.reason,
        worker_id=event.worker_id,
        created_at=event.created_at,
    )


def checkpoint_out(ckpt: CheckpointInfo, artifact_dir: Path | None = None) -> CheckpointOut:
    """A checkpoint as the API shows it: the path only relative to ``artifact_dir``
    (omitted without one), so the server's own directory layout stays private."""
    path = artifact_relative_path(artifact_dir, ckpt.path) if artifact_dir is not None else None
    return CheckpointOut(
        step=ckpt.step,
        epoch=ckpt.epoch,
        epoch_number=ckpt.epoch + 1,
        attempt=ckpt.attempt,
        size_bytes=ckpt.size_bytes,
        sha256=ckpt.sha256,
        created_at=ckpt.created_at,
        path=path,
        store=ckpt.store,
        file_name=ckpt.file_name,
    )


def worker_out(worker: WorkerView) -> WorkerOut:
    """A worker plus the jobs it holds; ``heartbeat_age_s`` measured now."""
    return WorkerOut(
        id=worker.id,
        host=worker.host,
        pid=worker.pid,
        launcher=worker.launcher,
        capacity=worker.capacity,
        started_at=worker.started_at,
        heartbeat_at=worker.heartbeat_at,
        stopped_at=worker.stopped_at,
        heartbeat_age_s=max(0.0, (datetime.now(UTC) - worker.heartbeat_at).total_seconds()),
        status=worker.status,
        running_jobs=list(worker.running_jobs),
    )


# ---- input documentation ---------------------------------------------------------------


def job_spec_openapi_schemas() -> dict[str, Any]:
    """JobSpec's JSON schema and its parts, keyed for ``components.schemas`` of OpenAPI.

    POST /jobs reads its body raw (so ``validate_spec`` reports every bad field at once);
    this puts the spec's schema into /docs all the same.
    """
    schema = JobSpec.model_json_schema(ref_template="#/components/schemas/{model}")
    defs: dict[str, Any] = schema.pop("$defs", {})
    return {**defs, "JobSpec": schema}
