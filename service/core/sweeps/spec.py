"""SweepSpec (POST /api/v1/sweeps) and its expansion into trials.

A sweep is a base JobSpec plus axes addressed by dotted paths (``service.core.spec.overrides``).
Expansion is deterministic: the grid axes' cartesian product (in the order the axes are
given) × ``samples`` draws of the random axes × ``seeds`` replicas. Sample ``s`` of a random
axis is drawn from ``random.Random(f"{sampler_seed}/{s}/{path}")``, so adding samples later
keeps the earlier draws, and a trial's identity never depends on how many others exist.

A trial's key is ``sha256`` of the canonical JSON of its overrides (sorted keys, no blanks)
as its validated job spec holds them (``sweep_identity``): the same overrides are the same
trial, which is what ``extend`` relies on to add only new ones.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from service.core.config import Settings
from service.core.errors import SpecValidationError
from service.core.limits import MAX_METRIC_NAME_CHARS, MAX_SEEDS
from service.core.metrics.main_metric import main_metric_name
from service.core.spec.model import JobSpec, validate_spec
from service.core.spec.overrides import OverridePathError, apply_overrides, split_path
from service.core.spec.text import json_value_problems
from service.core.sweeps.identity import (
    bool_problems,
    duplicate_error,
    held_overrides,
    repeated_axes,
)

MAX_TRIALS = 10_000  # trials one sweep may hold (after extends too)
MAX_AXES = 32
MAX_REPORTED_TRIAL_ERRORS = 100
SEED_PATH = "training.seed"
RANDOM_DIGITS = 6  # significant digits kept of a random draw (readable, and stable keys)
# Metrics that are better when larger; every other objective defaults to "min".
MAXIMISED_METRICS = frozenset({"accuracy", "eval_accuracy", "acc", "f1", "auc", "reward"})


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class GridAxis(_Part):
    """Every one of these values (any JSON: numbers, text, lists, objects)."""

    grid: list[Any] = Field(min_length=1, max_length=10_000)

    @model_validator(mode="after")
    def _storable(self) -> GridAxis:
        problems = json_value_problems(self.grid)
        if problems:
            where, msg = problems[0]
            raise ValueError(f"grid value {where[0] if where else ''}: {msg}")
        return self


class UniformAxis(_Part):
    """``samples`` draws, uniform in ``[lo, hi]``."""

    uniform: tuple[float, float]

    @model_validator(mode="after")
    def _ordered(self) -> UniformAxis:
        lo, hi = self.uniform
        if not lo < hi:
            raise ValueError("uniform needs [lo, hi] with lo < hi")
        if not math.isfinite(hi - lo):
            # rng.uniform computes lo + (hi - lo) * u: an infinite width draws inf or nan.
            raise ValueError(f"uniform [{lo}, {hi}] is too wide: hi - lo must be a finite number")
        return self


class LogUniformAxis(_Part):
    """``samples`` draws, uniform in log space within ``[lo, hi]`` (both > 0)."""

    loguniform: tuple[float, float]

    @model_validator(mode="after")
    def _ordered(self) -> LogUniformAxis:
        lo, hi = self.loguniform
        if not 0 < lo < hi:
            raise ValueError("loguniform needs [lo, hi] with 0 < lo < hi")
        return self


AXIS_KINDS = ("grid", "uniform", "loguniform")


def _axis_kind(value: Any) -> str | None:
    """Which axis form ``value`` is, by its one key (None: not an axis; pydantic then says
    which forms there are)."""
    if isinstance(value, BaseModel):
        return next(k for k in AXIS_KINDS if k in type(value).model_fields)
    if isinstance(value, dict):
        kinds = [k for k in AXIS_KINDS if k in value]
        return kinds[0] if len(kinds) == 1 else None
    return None


# An axis: {"grid": [...]} | {"uniform": [lo, hi]} | {"loguniform": [lo, hi]}; errors name
# the form's own field (axes.training.lr.grid), not every form that did not match.
Axis = Annotated[
    Annotated[GridAxis, Tag("grid")]
    | Annotated[UniformAxis, Tag("uniform")]
    | Annotated[LogUniformAxis, Tag("loguniform")],
    Discriminator(
        _axis_kind,
        custom_error_type="invalid_axis",
        custom_error_message="an axis is one of {grid: [values]}, {uniform: [lo, hi]}, "
        "{loguniform: [lo, hi]}",
    ),
]


class Objective(_Part):
    """What ranks trials: ``metric`` (default: the task's main metric), ``mode`` (default:
    max for accuracy-like names, else min), and ``at`` the ``best`` or the ``last`` value."""

    metric: str | None = Field(default=None, min_length=1, max_length=MAX_METRIC_NAME_CHARS)
    mode: Literal["max", "min"] | None = None
    at: Literal["best", "last"] = "last"


class Asha(_Part):
    """Asynchronous successive halving: rungs at ``rung_steps × reduction_factor^k`` steps."""

    rung_steps: int = Field(ge=1, le=10**12, description="Step of the first rung.")
    reduction_factor: int = Field(default=3, ge=2, le=100)


class EarlyStop(_Part):
    """The early-stopping rule of a sweep (one kind so far)."""

    asha: Asha


class SweepSpec(_Part):
    """A sweep as submitted. See DESIGN.md "Job spec" and SWEEP-API.md."""

    name: str = Field(min_length=1, max_length=180)
    base: dict[str, Any] = Field(description="A JobSpec: what every trial starts from.")
    axes: dict[str, Axis] = Field(default_factory=dict, max_length=MAX_AXES)
    samples: int = Field(default=1, ge=1, le=MAX_TRIALS, description="Draws of random axes.")
    seeds: int = Field(default=1, ge=1, le=MAX_SEEDS, description="Replicas: training.seed + k.")
    sampler_seed: int = Field(default=0, ge=0, le=2**32 - 1)
    objective: Objective | None = None
    max_concurrent: int | None = Field(default=None, ge=1, le=100_000)
    max_failed: int | None = Field(default=None, ge=1, le=MAX_TRIALS)
    early_stop: EarlyStop | None = None


@dataclass(frozen=True)
class ResolvedObjective:
    """An objective with its defaults filled in."""

    metric: str
    mode: Literal["max", "min"]
    at: Literal["best", "last"]

    def as_dict(self) -> dict[str, str]:
        """``{"metric", "mode", "at"}`` (stored with the sweep)."""
        return {"metric": self.metric, "mode": self.mode, "at": self.at}


def resolve_objective(spec: SweepSpec) -> ResolvedObjective:
    """``spec.objective`` with defaults: the base task's main metric, mode by its name."""
    given = spec.objective or Objective()
    task = spec.base.get("task")
    metric = given.metric or main_metric_name(task if isinstance(task, str) else "")
    mode = given.mode or ("max" if metric in MAXIMISED_METRICS else "min")
    return ResolvedObjective(metric, mode, given.at)


@dataclass(frozen=True)
class PlannedTrial:
    """One trial of an expansion: its position, key, overrides and validated job spec;
    ``index`` is its place in the expansion (what a 422 names: ``body.trials.<index>``)."""

    position: int
    key: str
    overrides: dict[str, Any]
    spec: JobSpec
    index: int = 0


def canonical_json(value: Any) -> str:
    """Sorted keys, no blanks, no NaN: equal values give equal text."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def trial_key(overrides: dict[str, Any]) -> str:
    """The trial's identity: sha256 hex of ``canonical_json(overrides)``."""
    return hashlib.sha256(canonical_json(overrides).encode()).hexdigest()


def _draw(path: str, axis: UniformAxis | LogUniformAxis, rng: random.Random) -> float:
    """One draw of a random axis, rounded to ``RANDOM_DIGITS`` significant digits.

    Raises:
        SpecValidationError: the draw is not a finite number (422 naming the axis).
    """
    try:
        if isinstance(axis, UniformAxis):
            value = rng.uniform(*axis.uniform)
        else:
            lo, hi = axis.loguniform
            value = math.exp(rng.uniform(math.log(lo), math.log(hi)))
        value = float(f"{value:.{RANDOM_DIGITS}g}")
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise _bad(["axes", path], f"{path}: a draw of this range is {value}: narrow the range")
    return value


def _bad(loc: list[Any], msg: str) -> SpecValidationError:
    return SpecValidationError([{"loc": ["body", *loc], "msg": msg, "type": "value_error"}])


def expand_overrides(spec: SweepSpec) -> list[dict[str, Any]]:
    """Every trial's overrides, in trial order (grid product × samples × seeds).

    Raises:
        SpecValidationError: a bad axis path, ``samples`` > 1 without a random axis, seeds
            together with a ``training.seed`` axis, or more than ``MAX_TRIALS`` trials.
    """
    for path in spec.axes:
        try:
            split_path(path)
        except OverridePathError as exc:
            raise _bad(["axes", path], exc.message) from None
    grid = [(p, a.grid) for p, a in spec.axes.items() if isinstance(a, GridAxis)]
    drawn = [(p, a) for p, a in spec.axes.items() if not isinstance(a, GridAxis)]
    if spec.samples > 1 and not drawn:
        raise _bad(
            ["samples"],
            "samples draws random axes, and this sweep has none: add a "
            "uniform/loguniform axis or set samples to 1",
        )
    if spec.seeds > 1 and SEED_PATH in spec.axes:
        raise _bad(["seeds"], f"{SEED_PATH} is an axis already: drop it or set seeds to 1")
    n = math.prod(len(values) for _, values in grid) * spec.samples * spec.seeds
    if n > MAX_TRIALS:
        raise _bad([], f"the sweep expands to {n} trials, more than {MAX_TRIALS}")
    base_seed = _base_seed(spec.base)
    draws = [
        {p: _draw(p, a, random.Random(f"{spec.sampler_seed}/{s}/{p}")) for p, a in drawn}
        for s in range(spec.samples)
    ]
    result: list[dict[str, Any]] = []
    for combo in itertools.product(*(values for _, values in grid)):
        for sample in draws:
            for k in range(spec.seeds):
                overrides = {p: v for (p, _), v in zip(grid, combo, strict=True)} | sample
                if SEED_PATH not in spec.axes:
                    overrides[SEED_PATH] = base_seed + k
                result.append(overrides)
    return result


def _base_seed(base: dict[str, Any]) -> int:
    training = base.get("training")
    seed = training.get("seed", 0) if isinstance(training, dict) else 0
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else 0


def trial_name(sweep_name: str, position: int) -> str:
    """A trial job's name: ``<sweep name>-<position>``."""
    return f"{sweep_name}-{position}"


def plan_trials(
    spec: SweepSpec,
    settings: Settings,
    *,
    skip_keys: frozenset[str] = frozenset(),
    first_position: int = 0,
    stored: bool = False,
) -> list[PlannedTrial]:
    """Expand ``spec`` and validate every trial's job spec (``validate_spec``), leaving out
    the trials whose key is in ``skip_keys`` (those a sweep already holds). Positions count
    on from ``first_position`` in expansion order. ``stored``: a stored sweep being extended
    (``validate_spec``'s ``stored``).

    Raises:
        SpecValidationError: the base is invalid (locs under ``body.base``), or trials are:
            one error per bad field, ``loc = ["body", "trials", i, "dotted.field"]`` and a
            message naming the trial's overrides (at most ``MAX_REPORTED_TRIAL_ERRORS``); an
            axis whose path no spec has once, at ``["body", "axes", path]``.
    """
    try:
        validate_spec(spec.base | {"name": trial_name(spec.name, 0)}, settings, stored=stored)
    except SpecValidationError as exc:
        raise SpecValidationError(
            [{**e, "loc": ["body", "base", *e["loc"][1:]]} for e in exc.errors]
        ) from None
    errors: list[dict[str, Any]] = []
    planned: list[PlannedTrial] = []
    position = first_position
    seen: dict[str, tuple[int, dict[str, Any]]] = {}  # key → (index, raw overrides)
    repeated = repeated_axes({p: a.grid for p, a in spec.axes.items() if isinstance(a, GridAxis)})
    said: set[str] = set()  # axes whose path no trial can have (told once, at the axis)
    for i, overrides in enumerate(expand_overrides(spec)):
        # Keys stored before keys were taken from validated values: skip those cheaply.
        if trial_key(overrides) in skip_keys:
            continue
        data = spec.base | {"name": trial_name(spec.name, position)}
        try:
            job_spec = validate_spec(apply_overrides(data, overrides), settings, stored=stored)
        except OverridePathError as exc:
            errors += axis_or_trial_error(i, overrides, exc.path, exc.message, axis_said=said)
        except SpecValidationError as exc:
            for e in exc.errors:
                field = ".".join(str(p) for p in e["loc"][1:]) or "spec"
                errors += axis_or_trial_error(
                    i, overrides, field, e["msg"], e["type"], axis_said=said
                )
        else:
            held = held_overrides(job_spec, overrides)
            key = trial_key(held)
            if key in skip_keys:
                continue
            for path in bool_problems(overrides, held):
                errors.append(
                    trial_error(i, overrides, path, "true/false where a number is expected")
                )
            if key in seen:
                errors.append(duplicate_error(seen[key], (i, overrides), held, repeated))
            seen.setdefault(key, (i, overrides))
            planned.append(PlannedTrial(position, key, held, job_spec, index=i))
        position += 1
        if len(errors) >= MAX_REPORTED_TRIAL_ERRORS:
            break
    if errors:
        raise SpecValidationError(errors[:MAX_REPORTED_TRIAL_ERRORS])
    return planned


# Errors of a path itself (no spec has such a field), the same for every trial's value.
_PATH_ERRORS = frozenset({"extra_forbidden", "override_path"})


def axis_or_trial_error(
    index: int,
    overrides: dict[str, Any],
    field: str,
    msg: str,
    kind: str = "override_path",
    *,
    axis_said: set[str],
) -> list[dict[str, Any]]:
    """The 422 items for one problem of trial ``index``: an axis whose path no job spec has
    (a typo: ``training.lrr``) once, at ``[body, axes, path]``, whatever trial meets it
    (``axis_said`` holds the axes told); any other problem as ``trial_error``."""
    if field in overrides and kind in _PATH_ERRORS:
        if field in axis_said:
            return []
        axis_said.add(field)
        return [{"loc": ["body", "axes", field], "msg": f"{field}: {msg}", "type": kind}]
    return [trial_error(index, overrides, field, msg, kind)]


def trial_error(
    index: int, overrides: dict[str, Any], field: str, msg: str, kind: str = "value_error"
) -> dict[str, Any]:
    """A 422 error item for trial ``index``: ``loc = [body, trials, index, field]``, the
    message naming the trial's overrides and the dotted ``field``."""
    return {
        "loc": ["body", "trials", index, field],
        "msg": f"trial {index} ({canonical_json(overrides)}): {field}: {msg}",
        "type": kind,
    }


class SweepExtension(_Part):
    """POST /sweeps/{id}/extend: more grid values of existing axes, more samples or seeds
    (new totals, not increments)."""

    axes: dict[str, GridAxis] = Field(default_factory=dict, max_length=MAX_AXES)
    samples: int | None = Field(default=None, ge=1, le=MAX_TRIALS)
    seeds: int | None = Field(default=None, ge=1, le=MAX_SEEDS)


def extended_spec(spec: SweepSpec, ext: SweepExtension) -> SweepSpec:
    """``spec`` with ``ext`` merged in: grid values appended (duplicates dropped), samples and
    seeds raised. Existing trials keep their keys, so expanding the result and skipping the
    sweep's keys yields exactly the new trials.

    Raises:
        SpecValidationError: a new axis (it would change every trial's overrides), a grid
            value for a random axis, or fewer samples/seeds than the sweep has.
    """
    axes = dict(spec.axes)
    for path, axis in ext.axes.items():
        old = axes.get(path)
        if old is None:
            raise _bad(
                ["axes", path],
                f"{path} is not an axis of this sweep (axes: "
                f"{', '.join(spec.axes) or 'none'}); a new axis would change every "
                "trial: submit a new sweep",
            )
        if not isinstance(old, GridAxis):
            raise _bad(["axes", path], f"{path} is a random axis: extend it with samples")
        seen = {canonical_json(v) for v in old.grid}
        added = [v for v in axis.grid if canonical_json(v) not in seen]
        axes[path] = GridAxis(grid=[*old.grid, *added])
    for field in ("samples", "seeds"):
        value = getattr(ext, field)
        if value is not None and value < getattr(spec, field):
            raise _bad(
                [field],
                f"{field}={value} is fewer than the sweep's "
                f"{getattr(spec, field)}: trials are never removed",
            )
    return spec.model_copy(
        update={
            "axes": axes,
            "samples": ext.samples or spec.samples,
            "seeds": ext.seeds or spec.seeds,
        }
    )
