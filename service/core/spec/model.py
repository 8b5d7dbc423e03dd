"""JobSpec (POST /api/v1/jobs): pydantic v2 models, frozen, unknown fields rejected.

``JobSpec.model_validate`` checks everything that needs no deployment settings; ``validate_spec``
adds the settings-dependent rules (allow-list, Slurm availability, caps) and the task's own
config schema, and reports every problem at once as ``SpecValidationError``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    model_validator,
)

from service.core.config import Settings
from service.core.errors import SpecValidationError
from service.core.launchers import (
    check_launcher_name,
    launcher_names,
    launcher_traits,
    multi_node_launchers,
)
from service.core.limits import MAX_JOB_NAME_CHARS, MAX_TAG_CHARS
from service.core.metrics.points import MAX_STEP
from service.core.spec.command import Command, Env, WorkspaceDigest, command_problems
from service.core.spec.deployment import settings_problems
from service.core.spec.errors import error_loc, pydantic_errors
from service.core.spec.followed import FollowedCheckpoints, ScriptMetrics
from service.core.spec.task_configs import BUILTIN_TASK_CONFIGS
from service.core.spec.text import display_text, json_value_problems

# A name with a row in LAUNCHER_TRAITS (checked at validation time, so a row added later
# counts); the OpenAPI enum lists the table's rows as the API process built its schema.
LauncherName = Annotated[
    str,
    AfterValidator(check_launcher_name),
    WithJsonSchema({"type": "string", "enum": list(launcher_names())}),
]
BackendName = Literal["auto", "nccl", "gloo"]
# Most errors one SpecValidationError reports.
MAX_REPORTED_ERRORS = 100
# training.stall_timeout_s: 30 min suits hours-long jobs whose steps, evals and checkpoints
# take minutes; below 10 s a busy host's scheduling jitter alone would look like a stall.
DEFAULT_STALL_TIMEOUT_S = 1800
MIN_STALL_TIMEOUT_S = 10
MAX_STALL_TIMEOUT_S = 7 * 24 * 3600


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Resources(_Part):
    """What one job asks for. Per node: ``nproc_per_node`` ranks and ``gpus_per_node`` GPUs."""

    nnodes: int = Field(default=1, ge=1)
    nproc_per_node: int = Field(default=1, ge=1)
    # le: the jobs table keeps it in a 32-bit INTEGER column (whatever DDPQ_MAX_GPUS_PER_NODE).
    gpus_per_node: int = Field(default=0, ge=0, le=2**31 - 1)
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
    max_steps: int | None = Field(
        default=None, ge=1, le=MAX_STEP, description="Stop after this global step."
    )
    batch_size: int = Field(default=32, ge=1, le=1_000_000, description="Per rank.")
    lr: float = Field(default=1e-3, gt=0, le=100)
    optimizer: Literal["sgd", "adam", "adamw"] = "adamw"
    seed: int = Field(default=0, ge=0, le=2**32 - 1)
    log_every_steps: int = Field(default=1, ge=1, le=MAX_STEP)
    checkpoint_every_steps: int | None = Field(default=None, ge=1, le=MAX_STEP)
    checkpoint_every_epochs: int | None = Field(default=None, ge=1, le=1_000_000)
    keep_checkpoints: int = Field(default=3, ge=1, le=1000)
    amp: bool = Field(default=True, description="bf16 autocast on GPU (ignored on CPU).")
    stall_timeout_s: int = Field(
        default=DEFAULT_STALL_TIMEOUT_S,
        ge=MIN_STALL_TIMEOUT_S,
        le=MAX_STALL_TIMEOUT_S,
        description=(
            "Seconds without a finished step before the job fails with reason 'stalled' "
            "(each rank's Python stacks go to its log). The first step gets as long."
        ),
    )
    nonfinite_loss: Literal["fail", "skip_step"] = Field(
        default="fail",
        description=(
            "A NaN/inf loss or gradient on any rank: 'fail' the job (reason "
            "'nonfinite_loss'), or 'skip_step' (no optimizer step on any rank; counted in "
            "the metric 'skipped_steps')."
        ),
    )

    @model_validator(mode="after")
    def _one_checkpoint_cadence(self) -> Training:
        if self.checkpoint_every_steps is not None and self.checkpoint_every_epochs is not None:
            raise ValueError("set checkpoint_every_steps or checkpoint_every_epochs, not both")
        return self


# Control characters (newline, carriage return, NUL, ...): each Slurm option becomes one
# ``#SBATCH`` line of a script, so a newline in a value would add lines of its own.
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _no_control_characters(value: str) -> str:
    if match := _CONTROL_RE.search(value):
        raise ValueError(
            f"must not contain control characters (found {match.group()!r}): each Slurm "
            "option is one #SBATCH line"
        )
    return value


SlurmText = Annotated[str, AfterValidator(_no_control_characters)]


class SlurmOptions(_Part):
    """Slurm placement; ``extra`` is passed to sbatch as ``--key=value``. No string of it
    (keys of ``extra`` included) may hold a control character."""

    partition: SlurmText | None = Field(default=None, max_length=200)
    account: SlurmText | None = Field(default=None, max_length=200)
    qos: SlurmText | None = Field(default=None, max_length=200)
    constraint: SlurmText | None = Field(default=None, max_length=500)
    time_limit_min: int | None = Field(default=None, ge=1)
    extra: dict[SlurmText, SlurmText] = Field(default_factory=dict)


def _step_or_latest(value: Any) -> Any:
    # One message instead of one per member of the union.
    if isinstance(value, str) and value != "latest":
        raise ValueError(f'step must be a step number or "latest", not {value!r}')
    return value


class InitFrom(_Part):
    """Start from another job's committed checkpoint (fine-tuning, or resuming at another
    ``nnodes``/``nproc_per_node``: a checkpoint holds the unwrapped model). Checked at submit:
    the caller must own ``job`` (or be an admin) and it must have a committed checkpoint at
    ``step``; ``"latest"`` is resolved to its newest step then, and ``sha256`` filled in, so
    the stored spec names exactly one file."""

    job: int = Field(ge=1, le=2**63 - 1, description="The source job's id.")
    step: Annotated[int | Literal["latest"], BeforeValidator(_step_or_latest)] = Field(
        default="latest", description='A step of a committed checkpoint of the job, or "latest".'
    )
    mode: Literal["weights_only", "full"] = Field(
        default="weights_only",
        description="weights_only: load the model; full: also the optimizer and step count.",
    )
    sha256: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="The checkpoint's sha256, filled in at submit; give it to insist on "
        "exactly that file.",
    )

    @model_validator(mode="after")
    def _step_in_range(self) -> InitFrom:
        if isinstance(self.step, int) and not 0 <= self.step <= MAX_STEP:
            raise ValueError(f'init_from.step must be 0–{MAX_STEP} or "latest"')
        return self


class JobSpec(_Part):
    """A training job as submitted. See DESIGN.md "Job spec"."""

    name: str = Field(min_length=1, max_length=MAX_JOB_NAME_CHARS)
    task: str | None = Field(
        default=None,
        min_length=1,
        max_length=300,
        description="A built-in task or an entrypoint 'package.module:function' (or command).",
    )
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
    init_from: InitFrom | None = None
    command: Command | None = Field(
        default=None,
        description="Your script and its arguments, as after `torchrun [options]`: "
        "['train.py', '--epochs', '3'] or ['-m', 'pkg.train']; run in `workspace`.",
    )
    workspace: WorkspaceDigest | None = Field(
        default=None, description="The digest of the uploaded directory a command runs in."
    )
    env: Env = Field(default_factory=dict, description="Variables set for every rank.")
    checkpoints: FollowedCheckpoints | None = Field(
        default=None, description="A command job: the checkpoint file its script writes."
    )
    metrics: ScriptMetrics | None = Field(
        default=None, description="A command job: where its script writes TensorBoard scalars."
    )

    @property
    def resolved_backend(self) -> Literal["nccl", "gloo"]:
        """``auto`` resolved: nccl when the job has GPUs, else gloo."""
        if self.backend == "auto":
            return "nccl" if self.resources.gpus_per_node > 0 else "gloo"
        return self.backend

    @property
    def world_size(self) -> int:
        """Ranks the job runs: 1 for strategy dp (one process), else nnodes × nproc_per_node."""
        return 1 if self.strategy == "dp" else self.resources.world_size

    @property
    def is_builtin_task(self) -> bool:
        """True for a built-in task name, False for an entrypoint or a command."""
        return self.task is not None and self.task in BUILTIN_TASK_CONFIGS

    @property
    def is_command(self) -> bool:
        """True for a command job (the user's script in a workspace)."""
        return self.command is not None


FAULT_RANK_KNOBS = ("fail_rank", "hang_rank", "nan_rank")
# The training fields a command job uses: ddpq's library in the script reads seed
# (ddpq.info), nonfinite_loss (ddpq.report) and max_steps (progress), and its followed
# checkpoints keep keep_checkpoints; every sweep trial carries a training.seed. The other
# fields drive the built-in training loop, which a command job does not run.
COMMAND_JOB_TRAINING_FIELDS = ("seed", "max_steps", "keep_checkpoints", "nonfinite_loss")


def command_training_problems(spec: JobSpec) -> list[tuple[tuple[str, ...], str]]:
    """A command job's training fields that its script never reads, set to other than their
    defaults (a stored spec holds every field at its default, and stays valid), as
    ``(loc, message)`` pairs."""
    if not spec.is_command:
        return []
    used = ", ".join(f"training.{f}" for f in COMMAND_JOB_TRAINING_FIELDS)
    problems: list[tuple[tuple[str, ...], str]] = []
    for field, info in Training.model_fields.items():
        if field in COMMAND_JOB_TRAINING_FIELDS:
            continue
        if getattr(spec.training, field) != info.get_default(call_default_factory=True):
            problems.append(
                (
                    ("training", field),
                    f"training.{field} applies to the built-in tasks (and entrypoints) only: "
                    "a command job runs your script, which never reads it; pass the value to "
                    "the script instead (an argument of the command, env, or config read "
                    f"with ddpq.config()). A command job uses only {used}",
                )
            )
    return problems


def cross_field_problems(spec: JobSpec) -> list[tuple[tuple[str, ...], str]]:
    """Rules that span fields, as ``(loc, message)`` pairs naming the field to change."""
    r = spec.resources
    problems: list[tuple[tuple[str, ...], str]] = []
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
    if not launcher_traits(spec.launcher).multi_node and r.nnodes != 1:
        one_host = f"launcher {spec.launcher} runs on one host: set nnodes=1 or use "
        problems.append((("resources", "nnodes"), one_host + " or ".join(multi_node_launchers())))
    if spec.slurm is not None and spec.launcher != "slurm":
        problems.append((("slurm",), "the slurm section applies only to launcher 'slurm'"))
    world_size = r.nnodes * r.nproc_per_node
    for knob in FAULT_RANK_KNOBS:  # the regression task's fault injection: a rank that exists
        rank = spec.config.get(knob) if spec.task == "regression" else None
        if isinstance(rank, int) and not isinstance(rank, bool) and rank >= world_size:
            problems.append(
                (
                    ("config", knob),
                    f"{knob}={rank} but the job has {world_size} rank(s), 0–{world_size - 1}; "
                    "the fault would never fire",
                )
            )
    for i, tag in enumerate(spec.tags):
        if not 1 <= len(tag) <= MAX_TAG_CHARS:
            problems.append((("tags", str(i)), f"each tag must be 1–{MAX_TAG_CHARS} characters"))
    return problems


def _task_config(data: Any) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """A built-in task's ``config`` validated on the raw ``data``: ``(normalised, errors)``;
    None when there is nothing to check (an entrypoint, or task/config of the wrong type)."""
    if not isinstance(data, dict):
        return None
    task, config = data.get("task"), data.get("config", {})
    schema = BUILTIN_TASK_CONFIGS.get(task) if isinstance(task, str) else None
    if schema is None or not isinstance(config, dict):
        return None
    try:
        return schema.model_validate(config).model_dump(), []
    except ValidationError as exc:
        return {}, pydantic_errors(exc, schema, ("config",))


def validate_spec(data: Any, settings: Settings, *, stored: bool = False) -> JobSpec:
    """Validate raw JSON ``data`` into a JobSpec under this deployment's ``settings``.
    ``stored``: ``data`` was accepted before (a sweep's base being extended), so the rules
    for new submissions only (``command_training_problems``) are left out: a stored sweep
    cannot be edited to meet them.

    Every problem is reported in one go: pydantic's field errors (unknown fields with a
    "did you mean" hint), the deployment's caps and rules, and the task's config errors,
    even when other fields are invalid; the cross-field rules need a built model, so they
    join only once the fields themselves are valid. Every value anywhere (keys and free-form
    ``config`` included) must be storable JSON (``spec_text.json_value_problems``): no lone
    surrogates or NUL, no NaN/Infinity, at most ``MAX_SPEC_DEPTH`` levels deep.

    Returns:
        The frozen spec, with the task's ``config`` normalised (defaults filled in).
    Raises:
        SpecValidationError: one ``{"loc": [...], "msg": str, "type": str}`` per problem.
    """
    errors: list[dict[str, Any]] = []
    spec: JobSpec | None = None
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        # Undecodable text is reported below, at the field that holds it.
        errors.extend(e for e in pydantic_errors(exc, JobSpec) if e["type"] != "string_unicode")

    def bad(loc: tuple[int | str, ...], msg: str) -> None:
        errors.append({"loc": error_loc(loc), "msg": msg, "type": "value_error"})

    if spec is not None:
        for loc, msg in cross_field_problems(spec):
            bad(loc, msg)
        for loc, msg in [] if stored else command_training_problems(spec):
            bad(loc, msg)
        dumped = spec.model_dump(include={"task", "command", "workspace", "checkpoints", "metrics"})
        for field, msg in command_problems(dumped, user_code_allowed=settings.user_code_allowed):
            bad((field,), msg)
    # Once the model built, check its coerced values ("200" and 200.0 became 200).
    view = spec.model_dump() if spec is not None else data
    for loc, msg in settings_problems(view, settings):
        bad(loc, msg)
    checked = _task_config(view)
    if checked is not None:
        errors.extend(checked[1])
    # Text, numbers and nesting anywhere (keys and config included), unless that field is
    # reported already; then the task's normalised config ("nan" coerced to NaN).
    seen = {tuple(e["loc"]) for e in errors}
    value_problems = json_value_problems(data)
    if checked is not None and not errors:
        value_problems += json_value_problems(checked[0], ("config",))
    for where, msg in value_problems:
        if tuple(error_loc(where)) not in seen:
            errors.append({"loc": error_loc(where), "msg": msg, "type": "value_error"})
    if errors or spec is None:
        raise SpecValidationError(
            [{**e, "msg": display_text(e["msg"])} for e in errors[:MAX_REPORTED_ERRORS]]
        )
    config = checked[0] if checked is not None else spec.config
    return spec.model_copy(update={"config": config})
