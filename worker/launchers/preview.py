"""Launch plans for a dry run: what a spec's launcher would run, built by that launcher's own
``plan`` (the very value a worker starts), secrets masked.

``POST /jobs?dry_run=true`` imports this module lazily: the one import of ``worker`` by the API
(an ``ignore_imports`` line of the "service never imports worker" contract). Building a plan
touches nothing and needs no torch; the plan is the one a worker of this deployment, started
with the API's settings in the API's working directory, would make.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.core.config import Settings
from service.core.spec.model import JobSpec
from worker.errors import LaunchError
from worker.launchers.base import mask_text, secret_values, with_attempt_token
from worker.launchers.registry import make_launcher

# Stands in for the attempt token the worker mints at launch; every render masks it.
PLACEHOLDER_TOKEN = "ddpqa_dry-run-placeholder"


@dataclass(frozen=True)
class PlanPreview:
    """One launcher's plan as a dry run shows it. ``text``: ``LaunchPlan.render()`` (the
    environment with secrets masked, the files it writes, the command line, the sbatch script
    if any); ``env_names``: the environment the ranks get on top of what they inherit, names
    only; ``error``: why this launcher could not plan the spec (then the rest is empty)."""

    launcher: str
    text: str = ""
    argv: list[str] = field(default_factory=list)
    env_names: list[str] = field(default_factory=list)
    script: str | None = None
    files: list[str] = field(default_factory=list)
    error: str | None = None


def preview_plans(
    spec: JobSpec, settings: Settings, *, job_id: int, attempt: int
) -> list[PlanPreview]:
    """The plan of every launcher that would run ``spec`` (its own ``launcher``) for
    ``attempt`` of job ``job_id``, as the worker would log it (attempt token included,
    masked). Touches nothing; a launcher that cannot plan the spec (e.g. ``slurm.extra``
    sets an option ddpq manages) gives a preview with ``error`` instead of raising."""
    try:
        launcher = make_launcher(spec.launcher, settings)
        plan = with_attempt_token(launcher.plan(spec, job_id, attempt), PLACEHOLDER_TOKEN)
    except (LaunchError, ValueError, OSError) as exc:
        return [PlanPreview(launcher=spec.launcher, error=f"{type(exc).__name__}: {exc}")]
    secrets = secret_values(plan.env)
    return [
        PlanPreview(
            launcher=plan.launcher,
            text=plan.render(),
            argv=[mask_text(a, secrets) for a in plan.argv],
            env_names=sorted(plan.env),
            script=mask_text(plan.script, secrets) if plan.script is not None else None,
            files=sorted(plan.files),
        )
    ]
