"""JobSpec (POST /api/v1/jobs): pydantic v2 models, frozen, unknown fields rejected.

``JobSpec.model_validate`` checks everything that needs no deployment settings; ``validate_spec``
adds the settings-dependent rules (allow-list, Slurm availability, caps) and the task's own
config schema, and reports every problem at once as ``SpecValidationError``.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from service.config import Settings
from service.errors import SpecValidationError
from service.task_configs import BUILTIN_TASK_CONFIGS

ENTRYPOINT_RE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
LauncherName = Literal["local", "slurm"]
BackendName = Literal["auto", "nccl", "gloo"]


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Resources(_Part):
    """What one job asks for. Per node: ``nproc_per_node`` ranks and ``gpus_per_node`` GPUs."""

    nnodes: int = Field(default=1, ge=1)
    nproc_per_node: int = Field(default=1, ge=1)
    gpus_per_node: int = Field(default=0, ge=0)
    cpus_per_task: int = Field(default=1, ge=1)
    mem_gb: float | None = Field(default=None, gt=0)
    timeout_min: int = Field(default=60, ge=1, description="Wall-clock limit in minutes.")

    @property
    def world_size(self) -> int:
        """Total ranks: ``nnodes × nproc_per_node``."""
        return self.nnodes * self.nproc_per_node


class Training(_Part):
    """Loop settings shared by the built-in tasks (entrypoints may read them too)."""

    epochs: int = Field(default=1, ge=1, le=1_000_000)
    max_steps: int | None = Field(default=None, ge=1, description="Stop after this global step.")
    batch_size: int = Field(default=32, ge=1, le=1_000_000, description="Per rank.")
    lr: float = Field(default=1e-3, gt=0, le=100)
    optimizer: Literal["sgd", "adam", "adamw"] = "adamw"
    seed: int = Field(default=0, ge=0, le=2**32 - 1)
    log_every_steps: int = Field(default=1, ge=1)
    checkpoint_every_steps: int | None = Field(default=None, ge=1)
    checkpoint_every_epochs: int | None = Field(default=None, ge=1)
    keep_checkpoints: int = Field(default=3, ge=1, le=1000)
    amp: bool = Field(default=True, description="bf16 autocast on GPU (ignored on CPU).")

    @model_validator(mode="after")
    def _one_checkpoint_cadence(self) -> Training:
        if self.checkpoint_every_steps is not None and self.checkpoint_every_epochs is not None:
            raise ValueError("set checkpoint_every_steps or checkpoint_every_epochs, not both")
        return self


class SlurmOptions(_Part):
    """Slurm placement; ``extra`` is passed to sbatch as ``--key=value``."""

    partition: str | None = Field(default=None, max_length=200)
    account: str | None = Field(default=None, max_length=200)
    qos: str | None = Field(default=None, max_length=200)
    constraint: str | None = Field(default=None, max_length=500)
    time_limit_min: int | None = Field(default=None, ge=1)
    extra: dict[str, str] = Field(default_factory=dict)


class JobSpec(_Part):
    """A training job as submitted. See DESIGN.md "Job spec"."""

    name: str = Field(min_length=1, max_length=200)
    task: str = Field(min_length=1, max_length=300)
    config: dict[str, Any] = Field(default_factory=dict)
    launcher: LauncherName = "local"
    resources: Resources = Field(default_factory=Resources)
    backend: BackendName = "auto"
    strategy: Literal["ddp", "dp"] = Field(
        default="ddp",
        description="ddp: one process per rank; dp: nn.DataParallel in one process (GPUs).",
    )
    training: Training = Field(default_factory=Training)
    slurm: SlurmOptions | None = None
    max_restarts: int = Field(default=0, ge=0, le=100)
    priority: int = Field(default=0, ge=-1000, le=1000)
    tags: list[str] = Field(default_factory=list, max_length=50)

    @property
    def resolved_backend(self) -> Literal["nccl", "gloo"]:
        """``auto`` resolved: nccl when the job has GPUs, else gloo."""
        if self.backend == "auto":
            return "nccl" if self.resources.gpus_per_node > 0 else "gloo"
        return self.backend

    @property
    def is_builtin_task(self) -> bool:
        """True for a built-in task name, False for an entrypoint."""
        return self.task in BUILTIN_TASK_CONFIGS


def cross_field_problems(spec: JobSpec) -> list[tuple[tuple[str, ...], str]]:
    """Rules that span fields, as ``(loc, message)`` pairs naming the field to change."""
    r = spec.resources
    problems: list[tuple[tuple[str, ...], str]] = []
    if spec.task not in BUILTIN_TASK_CONFIGS and not ENTRYPOINT_RE.match(spec.task):
        problems.append(
            (
                ("task",),
                f"task {spec.task!r} is neither a built-in task "
                f"({', '.join(sorted(BUILTIN_TASK_CONFIGS))}) nor an entrypoint "
                "'package.module:function'",
            )
        )
    if spec.backend == "nccl" and r.gpus_per_node == 0:
        problems.append(
            (("backend",), "backend nccl needs GPUs: set resources.gpus_per_node ≥ 1 or use gloo")
        )
    if (
        spec.resolved_backend == "nccl"
        and spec.strategy == "ddp"
        and 0 < r.gpus_per_node < r.nproc_per_node
    ):
        problems.append(
            (
                ("resources", "nproc_per_node"),
                f"backend nccl needs one GPU per rank: nproc_per_node={r.nproc_per_node} > "
                f"gpus_per_node={r.gpus_per_node}; lower nproc_per_node or use backend gloo",
            )
        )
    if spec.strategy == "dp" and (r.nnodes != 1 or r.nproc_per_node != 1):
        problems.append(
            (("strategy",), "strategy dp runs one process: set nnodes=1 and nproc_per_node=1")
        )
    if spec.launcher == "local" and r.nnodes != 1:
        problems.append(
            (("resources", "nnodes"), "launcher local runs on one host: set nnodes=1 or use slurm")
        )
    if spec.slurm is not None and spec.launcher != "slurm":
        problems.append((("slurm",), "the slurm section applies only to launcher 'slurm'"))
    for i, tag in enumerate(spec.tags):
        if not 1 <= len(tag) <= 100:
            problems.append((("tags", str(i)), "each tag must be 1–100 characters"))
    return problems


def _loc(parts: tuple[int | str, ...]) -> list[int | str]:
    return ["body", *parts]


def validate_spec(data: Any, settings: Settings) -> JobSpec:
    """Validate raw JSON ``data`` into a JobSpec under this deployment's ``settings``.

    Returns:
        The frozen spec, with the task's ``config`` normalised (defaults filled in).
    Raises:
        SpecValidationError: one ``{"loc": [...], "msg": str, "type": str}`` per problem.
    """
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecValidationError(
            [
                {"loc": _loc(tuple(e["loc"])), "msg": e["msg"], "type": e["type"]}
                for e in exc.errors(include_url=False, include_context=False, include_input=False)
            ]
        ) from None
    errors: list[dict[str, Any]] = []

    def bad(loc: tuple[int | str, ...], msg: str) -> None:
        errors.append({"loc": _loc(loc), "msg": msg, "type": "value_error"})

    for loc, msg in cross_field_problems(spec):
        bad(loc, msg)
    r = spec.resources
    caps = (
        ("nnodes", r.nnodes, settings.max_nnodes),
        ("nproc_per_node", r.nproc_per_node, settings.max_nproc_per_node),
        ("gpus_per_node", r.gpus_per_node, settings.max_gpus_per_node),
        ("timeout_min", r.timeout_min, settings.max_timeout_min),
    )
    for field, value, cap in caps:
        if value > cap:
            bad(("resources", field), f"{field}={value} exceeds this deployment's cap of {cap}")
    if spec.launcher == "slurm" and not settings.slurm_enabled:
        bad(("launcher",), "this deployment has no Slurm (DDPQ_SLURM_ENABLED is off); use 'local'")
    config = spec.config
    schema = BUILTIN_TASK_CONFIGS.get(spec.task)
    if schema is not None:
        try:
            config = schema.model_validate(spec.config).model_dump()
        except ValidationError as exc:
            for e in exc.errors(include_url=False, include_context=False, include_input=False):
                errors.append(
                    {"loc": _loc(("config", *e["loc"])), "msg": e["msg"], "type": e["type"]}
                )
    elif ENTRYPOINT_RE.match(spec.task) and not settings.entrypoint_allowed(spec.task):
        allowed = ", ".join(settings.allowed_entrypoints) or "none configured"
        bad(
            ("task",),
            f"entrypoint {spec.task!r} is not on this deployment's allow-list "
            f"(DDPQ_ALLOWED_ENTRYPOINTS: {allowed}); built-in tasks: "
            f"{', '.join(sorted(BUILTIN_TASK_CONFIGS))}",
        )
    if errors:
        raise SpecValidationError(errors)
    return spec.model_copy(update={"config": config})
