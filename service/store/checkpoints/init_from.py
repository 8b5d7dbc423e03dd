"""A job's ``init_from``: resolved against the source job's committed checkpoints at submit,
and described to the new job's ranks (``GET /attempts/self``).

Ownership follows the other owner checks: a source job of another owner is reported exactly
as a job that does not exist, so a submit tells nobody that someone else's job is there.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.core.errors import SpecValidationError
from service.core.spec.errors import error_loc
from service.core.spec.model import JobSpec
from service.store.checkpoints.crud import list_checkpoints
from service.store.models import Checkpoint, Job

SHOWN_STEPS = 10  # steps a "no such checkpoint" message lists


def _bad(field: str, msg: str) -> SpecValidationError:
    return SpecValidationError(
        [{"loc": error_loc(("init_from", field)), "msg": msg, "type": "value_error"}]
    )


def resolve_init_from(session: Session, spec: JobSpec, *, owner: str | None) -> JobSpec:
    """``spec`` with its ``init_from`` resolved: a concrete ``step`` and that checkpoint's
    ``sha256`` (unchanged without an ``init_from``).

    Args:
        owner: the caller's owner filter (None: an admin, or auth off: any job).
    Raises:
        SpecValidationError: (422) ``init_from.job`` names no job of the caller's;
            ``init_from.step`` no committed checkpoint of it (or none at all for
            ``"latest"``); ``init_from.sha256`` another file than the one at that step.
    """
    init = spec.init_from
    if init is None:
        return spec
    source = session.get(Job, init.job)
    if source is None or (owner is not None and source.owner != owner):
        raise _bad("job", f"job {init.job} not found")
    live = list_checkpoints(session, init.job)
    if init.step == "latest":
        if not live:
            raise _bad("step", f"job {init.job} has no committed checkpoint yet")
        ckpt = live[0]
    else:
        found = [c for c in live if c.step == init.step]
        if not found:
            steps = ", ".join(str(c.step) for c in live[:SHOWN_STEPS]) or "none"
            raise _bad(
                "step",
                f"job {init.job} has no committed checkpoint at step {init.step} (its "
                f'checkpoints, newest first: {steps}); name one of them or "latest"',
            )
        ckpt = found[0]
    if init.sha256 is not None and init.sha256 != ckpt.sha256:
        raise _bad(
            "sha256",
            f"job {init.job}'s checkpoint at step {ckpt.step} has sha256 {ckpt.sha256}, "
            f"not {init.sha256}",
        )
    _check_left_to_train(spec, ckpt.step)
    resolved = init.model_copy(update={"step": ckpt.step, "sha256": ckpt.sha256})
    return spec.model_copy(update={"init_from": resolved})


def _check_left_to_train(spec: JobSpec, step: int) -> None:
    """A ``full`` start restores the step count: from ``step`` ≥ the job's total steps it
    would train nothing and "succeed". Known at submit only with ``training.max_steps``
    (epochs × steps per epoch is known only once the data is loaded; the rank says so then).

    Raises:
        SpecValidationError: (422) at ``init_from.step``.
    """
    init, total = spec.init_from, spec.training.max_steps
    if init is not None and init.mode == "full" and total is not None and step >= total:
        raise _bad(
            "step",
            f"mode full restores step {step}, which is not below this job's "
            f"training.max_steps {total}: nothing would be trained; raise training.max_steps, "
            "name an earlier step, or use mode weights_only",
        )


def same_submission(stored: dict[str, Any], spec: JobSpec) -> bool:
    """Whether a replayed submit (same Idempotency-Key) sent the spec stored as ``stored``:
    an ``init_from`` of step ``"latest"`` matches the step it was resolved to then."""
    sent = spec.model_dump(mode="json")
    init = sent.get("init_from")
    if isinstance(init, dict) and isinstance(stored.get("init_from"), dict):
        was = stored["init_from"]
        if init.get("step") == "latest":
            init = {**init, "step": was.get("step")}
        if init.get("sha256") is None:
            init = {**init, "sha256": was.get("sha256")}
        sent["init_from"] = init
    return sent == stored


def init_from_checkpoint(session: Session, job_id: int) -> tuple[Job, Checkpoint | None] | None:
    """The job's ``init_from`` source checkpoint row (live or not; None when it is gone),
    or None when the job has no ``init_from``."""
    job = session.get(Job, job_id)
    if job is None or job.init_from_job_id is None or job.init_from_step is None:
        return None
    ckpt = session.scalars(
        select(Checkpoint).where(
            Checkpoint.job_id == job.init_from_job_id, Checkpoint.step == job.init_from_step
        )
    ).one_or_none()
    return job, ckpt


def describe_init_from(session: Session, job_id: int) -> dict[str, Any] | None:
    """The job's ``init_from`` as the wire's ``InitFrom`` fields (job_id, step, sha256,
    size_bytes, mode), or None when it has none."""
    found = init_from_checkpoint(session, job_id)
    if found is None:
        return None
    job, ckpt = found
    init = (job.spec or {}).get("init_from") or {}
    return {
        "job_id": job.init_from_job_id,
        "step": job.init_from_step,
        "sha256": init.get("sha256") or (ckpt.sha256 if ckpt is not None else ""),
        "size_bytes": ckpt.size_bytes if ckpt is not None else 0,
        "mode": init.get("mode") or "weights_only",
    }
