"""What `ddpq sweep submit` checks before it sends anything (the sweep file against the spec
model the API uses, every trial expanded and validated), and its --dry-run output: the
trials, and the first trial as the API would run it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from service.cli.common import exit_invalid
from service.cli.output import cell
from service.cli.queue_output import format_dry_run
from service.client import ApiError, DdpqClient
from service.core.config import Settings
from service.core.errors import SpecValidationError
from service.core.spec.deployment import spec_rules_only
from service.core.spec.errors import pydantic_errors
from service.core.sweeps.spec import (
    PlannedTrial,
    SweepSpec,
    plan_trials,
    resolve_objective,
    trial_error,
)

MAX_TRIALS_SHOWN = 50  # rows of the dry run's trials table; --json lists every trial


@dataclass(frozen=True)
class SweepPlan:
    """A sweep file validated as the API would: the model and its expanded trials."""

    spec: SweepSpec
    trials: list[PlannedTrial]

    def as_json(self, first_trial: dict[str, Any] | None) -> dict[str, Any]:
        """The dry run's ``--json`` answer: ``{dry_run, name, objective, trials: [{position,
        key, overrides}], first_trial}`` (``first_trial``: the API's dry run of trial 0)."""
        return {
            "dry_run": True,
            "name": self.spec.name,
            "objective": resolve_objective(self.spec).as_dict(),
            "trials": [
                {"position": t.position, "key": t.key, "overrides": t.overrides}
                for t in self.trials
            ],
            "first_trial": first_trial,
        }


def check_sweep(spec: dict[str, Any], settings: Settings) -> SweepPlan:
    """Validate a sweep file's ``spec`` (its base's workspace already a digest) with the API's
    own model: the sweep's fields, then every trial expanded and validated as a job spec.
    Only the rules that hold on every deployment are checked here (``spec_rules_only``); the
    deployment's own (caps, Slurm, allow-list) are the API's at submit.

    Exits 2 listing every problem, as the API's 422 would (``trials.0.training.lr: …``),
    before anything is sent.
    """
    try:
        # As the API reads the body: JSON text (NaN refused like the server refuses it).
        sweep = SweepSpec.model_validate_json(json.dumps(spec, allow_nan=True))
        return SweepPlan(sweep, plan_trials(sweep, spec_rules_only(settings)))
    except ValidationError as exc:
        errors = pydantic_errors(exc, SweepSpec)
    except SpecValidationError as exc:
        errors = exc.errors
    exit_invalid("the sweep", errors)


def dry_run_first_trial(client: DdpqClient, plan: SweepPlan) -> dict[str, Any]:
    """The API's dry run (``POST /jobs?dry_run=true``, nothing stored) of the sweep's first
    trial: its launch plans and queue, checked against the deployment's own rules. A 422
    names the trial and its field, as the sweep's own 422 would."""
    first = plan.trials[0]
    try:
        return client.dry_run(first.spec.model_dump(mode="json"))
    except ApiError as exc:
        if exc.status_code != 422 or not isinstance(exc.detail, list):
            raise
        errors = []
        for e in exc.detail:
            loc = e.get("loc", []) if isinstance(e, dict) else []
            field = ".".join(str(p) for p in loc[1:]) or "spec"
            msg = e.get("msg", str(e)) if isinstance(e, dict) else str(e)
            errors.append(trial_error(first.index, first.overrides, field, msg))
        raise ApiError(422, errors, exc.code) from None


def format_sweep_plan(plan: SweepPlan, first_trial: dict[str, Any]) -> RenderableType:
    """The dry run for people: the trial count and objective, the trials table (position and
    overrides, the first ``MAX_TRIALS_SHOWN``), then trial 0 as ``ddpq submit --dry-run``
    shows a job, ending by saying that nothing was stored."""
    spec, trials = plan.spec, plan.trials
    objective = resolve_objective(spec)
    parts: list[RenderableType] = [
        cell(
            f"sweep {spec.name!r}: {len(trials)} trials; objective {objective.metric} "
            f"({objective.mode}, {objective.at} value)"
        )
    ]
    paths = sorted({p for t in trials for p in t.overrides})
    table = Table("#", *paths, title=cell(f"sweep {spec.name!r} trials"))
    for t in trials[:MAX_TRIALS_SHOWN]:
        table.add_row(cell(t.position), *(cell(json.dumps(t.overrides.get(p, ""))) for p in paths))
    parts.append(table)
    if len(trials) > MAX_TRIALS_SHOWN:
        more = len(trials) - MAX_TRIALS_SHOWN
        parts.append(cell(f"… and {more} more trials (--json lists every one)"))
    parts.append(Text(f"# trial 0 ({trials[0].spec.name})", style="bold"))
    parts.append(format_dry_run(first_trial))
    return Group(*parts)
