"""``POST /jobs?dry_run=true``: what submitting a spec would do, storing nothing — the
normalised spec, the launch plan its launcher would run, where an existing job's next attempt
would resume, and why it would wait.

The store plans the submission (``service.store.jobs.service.plan_submission``); the launch
plan comes from the launcher's own ``plan`` (``worker.launchers.preview``, imported here
lazily: the API's only import of ``worker``; see docs/architecture.md).
"""

from __future__ import annotations

from service.api.deps import RequestContext
from service.api.queue_schemas import DryRunOut, InitStartOut, PlanOut, ResumeOut, queue_out
from service.core.spec.model import JobSpec
from service.store.jobs import service as jobs
from service.store.jobs.values import ResumePoint

# The job id a plan shows for a spec not stored yet (ids start at 1).
UNSTORED_JOB_ID = 0


def dry_run(ctx: RequestContext, spec: JobSpec, job_id: int | None) -> DryRunOut:
    """The dry run's answer for ``spec`` (validated), as the next attempt of job ``job_id``
    when given (the caller must be allowed to see it). Reads only.

    Raises:
        NotFoundError: ``job_id`` names no job the caller may see (404).
        SpecValidationError: (422) ``init_from`` would be refused by the real submit.
    """
    from worker.launchers.preview import preview_plans

    plan = jobs.plan_submission(
        ctx.db,
        spec,
        owner=ctx.owner,
        job_id=job_id,
        heartbeat_interval_s=ctx.settings.heartbeat_interval_s,
        max_gpus_per_node=ctx.settings.max_gpus_per_node,
        starting_launcher=ctx.settings.expect_worker,
    )
    spec = plan.spec
    previews = preview_plans(
        spec, ctx.settings, job_id=job_id or UNSTORED_JOB_ID, attempt=plan.attempt
    )
    return DryRunOut(
        spec=spec.model_dump(mode="json"),
        job_id=job_id,
        attempt=plan.attempt,
        plans=[PlanOut(**vars(p)) for p in previews],
        resume=_resume_out(plan.resume) if plan.resume is not None else None,
        queue=queue_out(plan.queue),
        warnings=list(plan.warnings),
        init_from=_init_start(spec),
    )


def _resume_out(resume: ResumePoint) -> ResumeOut:
    return ResumeOut(
        job_id=resume.job_id,
        attempt=resume.attempt,
        step=resume.step,
        epoch=resume.epoch,
        checkpoint_attempt=resume.checkpoint_attempt,
        note=(
            f"resumes from the checkpoint at step {resume.step} if its file verifies "
            "(size and sha256), else from the newest older one that does"
            if resume.step is not None
            else "no checkpoint: starts from step 0"
        ),
    )


def _init_start(spec: JobSpec) -> InitStartOut | None:
    init = spec.init_from
    if init is None or not isinstance(init.step, int) or init.sha256 is None:
        return None
    return InitStartOut(job=init.job, step=init.step, sha256=init.sha256, mode=init.mode)
