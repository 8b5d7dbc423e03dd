"""``POST /jobs?dry_run=true``: what submitting a spec would do, storing nothing — the
normalised spec, the launch plan its launcher would run, where an existing job's next attempt
would resume, and why it would wait.

The plan comes from the launcher's own ``plan`` (``worker.launchers.preview``, imported here
lazily: the API's only import of ``worker``; see docs/architecture.md).
"""

from __future__ import annotations

from service.api.deps import RequestContext
from service.api.queue_schemas import DryRunOut, InitStartOut, PlanOut, ResumeOut, queue_out
from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.store.checkpoints.crud import list_checkpoints
from service.store.checkpoints.init_from import resolve_init_from
from service.store.jobs.crud import get_job
from service.store.jobs.queue import JobShape, explain_queue, submit_warnings

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

    r = spec.resources
    resume: ResumeOut | None = None
    attempt = 1
    shape = JobShape(spec.launcher, r.gpus_per_node, r.nproc_per_node, spec.priority)
    with ctx.db.session(write=False) as session:
        spec = resolve_init_from(session, spec, owner=ctx.owner)  # the submit's own check
        if job_id is not None:
            job = get_job(session, job_id, owner=ctx.owner)
            # A queued job's attempt is its next launch (a requeue already counted it).
            attempt = job.attempt if job.state == JobState.QUEUED.value else job.attempt + 1
            newest = next(iter(list_checkpoints(session, job_id)), None)
            resume = ResumeOut(
                job_id=job_id,
                attempt=attempt,
                step=newest.step if newest else None,
                epoch=newest.epoch if newest else None,
                checkpoint_attempt=newest.attempt if newest else None,
                note=(
                    f"resumes from the checkpoint at step {newest.step} if its file verifies "
                    "(size and sha256), else from the newest older one that does"
                    if newest
                    else "no checkpoint: starts from step 0"
                ),
            )
            shape = JobShape(
                spec.launcher, r.gpus_per_node, r.nproc_per_node, spec.priority, job_id=job_id
            )
        explanation = explain_queue(
            session,
            shape,
            viewer=ctx.owner,
            heartbeat_interval_s=ctx.settings.heartbeat_interval_s,
            max_gpus_per_node=ctx.settings.max_gpus_per_node,
        )
        warnings = submit_warnings(
            session, shape, heartbeat_interval_s=ctx.settings.heartbeat_interval_s
        )
    previews = preview_plans(spec, ctx.settings, job_id=job_id or UNSTORED_JOB_ID, attempt=attempt)
    return DryRunOut(
        spec=spec.model_dump(mode="json"),
        job_id=job_id,
        attempt=attempt,
        plans=[PlanOut(**vars(p)) for p in previews],
        resume=resume,
        queue=queue_out(explanation),
        warnings=warnings,
        init_from=_init_start(spec),
    )


def _init_start(spec: JobSpec) -> InitStartOut | None:
    init = spec.init_from
    if init is None or not isinstance(init.step, int) or init.sha256 is None:
        return None
    return InitStartOut(job=init.job, step=init.step, sha256=init.sha256, mode=init.mode)
