"""A sweep's ``init_from``: every trial's resolved exactly as ``POST /jobs`` resolves a job's
(``init_from.resolve_init_from``: only a job the caller may read, only a committed checkpoint,
``"latest"`` made a concrete step with its sha256), and a retried trial's start point (its
failed job's own newest checkpoint).

When no axis touches ``init_from`` the base's is resolved once and stored in the sweep's
spec, so trials added later by ``extend`` start from the very file the first ones did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy.orm import Session

from service.core.errors import SpecValidationError
from service.core.spec.model import InitFrom, JobSpec
from service.core.sweeps.spec import PlannedTrial, SweepSpec, trial_error
from service.store.checkpoints.crud import list_checkpoints
from service.store.checkpoints.init_from import resolve_init_from
from service.store.models import Job

INIT_FROM = "init_from"


def _touches_init_from(spec: SweepSpec) -> bool:
    return any(p == INIT_FROM or p.startswith(INIT_FROM + ".") for p in spec.axes)


def resolve_sweep_init_from(
    session: Session, spec: SweepSpec, planned: Sequence[PlannedTrial], *, owner: str | None
) -> tuple[SweepSpec, list[PlannedTrial]]:
    """``spec`` and ``planned`` with every trial's ``init_from`` resolved (unchanged where a
    trial has none).

    Args:
        owner: the caller's owner filter (None: an admin, or auth off: any job).
    Returns:
        ``(spec, trials)``: the spec's base carries the resolved ``init_from`` when no axis
        touches it (the same for every trial); the trials' specs carry theirs.
    Raises:
        SpecValidationError: (422) the base's ``init_from`` is invalid (``loc`` under
            ``body.base.init_from``), or trials' are (``[body, trials, <index>,
            "init_from.<field>"]``, the message naming the trial); another owner's job is
            reported exactly as a job that does not exist.
    """
    if not planned or all(t.spec.init_from is None for t in planned):
        return spec, list(planned)
    if not _touches_init_from(spec):
        first = planned[0].spec
        try:
            resolved = resolve_init_from(session, first, owner=owner).init_from
        except SpecValidationError as exc:
            raise SpecValidationError(
                [{**e, "loc": ["body", "base", *e["loc"][1:]]} for e in exc.errors]
            ) from None
        assert resolved is not None
        base = spec.base | {INIT_FROM: resolved.model_dump(mode="json")}
        trials = [replace(t, spec=t.spec.model_copy(update={INIT_FROM: resolved})) for t in planned]
        return spec.model_copy(update={"base": base}), trials
    # Axes name the source: resolve each distinct init_from once.
    seen: dict[InitFrom, InitFrom | SpecValidationError] = {}
    errors: list[dict[str, Any]] = []
    trials = []
    for t in planned:
        init = t.spec.init_from
        if init is None:
            trials.append(t)
            continue
        if init not in seen:
            try:
                seen[init] = resolve_init_from(session, t.spec, owner=owner).init_from or init
            except SpecValidationError as exc:
                seen[init] = exc
        outcome = seen[init]
        if isinstance(outcome, SpecValidationError):
            for e in outcome.errors:
                field = ".".join(str(p) for p in e["loc"][1:])
                errors.append(trial_error(t.index, t.overrides, field, e["msg"], e["type"]))
        else:
            trials.append(replace(t, spec=t.spec.model_copy(update={INIT_FROM: outcome})))
    if errors:
        raise SpecValidationError(errors)
    return spec, trials


def retry_start(session: Session, failed: Job) -> dict[str, Any]:
    """The spec (JSON) of the job that retries ``failed``: its own, continuing from its own
    newest committed checkpoint (``init_from`` that checkpoint, mode ``full``: weights,
    optimizer and step count) when it has one; unchanged (a fresh start) when it has none."""
    live = list_checkpoints(session, failed.id)
    if not live:
        return dict(failed.spec)
    newest = live[0]
    init = InitFrom(job=failed.id, step=newest.step, mode="full", sha256=newest.sha256)
    return dict(failed.spec) | {INIT_FROM: init.model_dump(mode="json")}


def init_from_columns(spec: JobSpec | dict[str, Any]) -> dict[str, int | None]:
    """``jobs.init_from_job_id`` / ``init_from_step`` of a resolved spec (what retention's
    pins read): both None without an ``init_from``."""
    init = spec.init_from if isinstance(spec, JobSpec) else spec.get(INIT_FROM)
    job: Any
    step: Any
    if isinstance(init, InitFrom):
        job, step = init.job, init.step
    elif isinstance(init, dict):
        job, step = init.get("job"), init.get("step")
    else:
        return {"init_from_job_id": None, "init_from_step": None}
    return {
        "init_from_job_id": job if isinstance(job, int) else None,
        "init_from_step": step if isinstance(step, int) and not isinstance(step, bool) else None,
    }


def trial_workspaces(planned: Sequence[PlannedTrial]) -> list[tuple[str, list[str]]]:
    """The distinct workspaces the trials name, each with the field a 422 points at (the
    base's, ``body.base.workspace``, unless an axis set it)."""
    found: dict[str, list[str]] = {}
    for t in planned:
        if t.spec.workspace is not None:
            found.setdefault(t.spec.workspace, ["body", "base", "workspace"])
    return list(found.items())
