"""Routes of the job resource: submit, list, get, cancel, events."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from service.api.claim_waits import claim_waits
from service.api.deps import REQUIRE_CALLER, UNAUTHORIZED, ContextDep
from service.api.http import ERRORS, MAX_INT64, JobIdPath, etag_response, json_response
from service.api.jobs.dry_run import dry_run as dry_run_answer
from service.api.queue_schemas import DryRunOut
from service.api.schemas import (
    EventListOut,
    JobListOut,
    JobOut,
    SubmittedJobOut,
    event_out,
    job_out,
)
from service.core.config import Settings
from service.core.errors import SpecValidationError
from service.core.limits import (
    DEFAULT_PAGE_ITEMS,
    MAX_IDEMPOTENCY_KEY_CHARS,
    MAX_JOB_NAME_CHARS,
    MAX_TAG_CHARS,
)
from service.core.owners.rank_users import check_submitter
from service.core.spec.model import JobSpec, validate_spec
from service.core.states import JobState
from service.store.jobs import service as jobs

router = APIRouter(tags=["jobs"], dependencies=[REQUIRE_CALLER], responses=UNAUTHORIZED)

# The list's text filters: no control characters (a NUL is refused by PostgreSQL) and not
# only blanks; names are up to 200 characters, tags up to 100.
TEXT_FILTER_PATTERN = r"^[^\x00-\x1f\x7f]*[^\s\x00-\x1f\x7f][^\x00-\x1f\x7f]*$"

SPEC_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/JobSpec"}}},
    }
}


def parse_json_body(raw: bytes) -> Any:
    """Decode a request body as JSON for spec validation (``validate_spec`` then checks
    every value: text, numbers, nesting).

    Raises:
        SpecValidationError: empty, not JSON, or nested too deeply for the parser.
    """

    def bad(msg: str) -> SpecValidationError:
        return SpecValidationError([{"loc": ["body"], "msg": msg, "type": "json_invalid"}])

    if not raw.strip():
        raise bad("request body is empty: send the job spec as a JSON object")
    try:
        return json.loads(raw)
    except RecursionError:
        raise bad("JSON nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise bad(f"invalid JSON: {exc}") from None


def _validated(raw: bytes, settings: Settings) -> JobSpec:
    return validate_spec(parse_json_body(raw), settings)


@router.post(
    "/jobs",
    status_code=201,
    response_model=SubmittedJobOut,
    summary="Submit a job (or plan one: dry_run=true)",
    openapi_extra=SPEC_BODY,
    responses={
        200: {
            "model": SubmittedJobOut | DryRunOut,
            "description": "Replay of an earlier Idempotency-Key; or, with dry_run=true, what "
            "would happen (nothing stored)",
        },
        404: {"description": "dry_run with a job_id the caller may not see"},
        413: {"description": "Body larger than DDPQ_MAX_BODY_BYTES"},
        422: ERRORS[422],
        429: {"description": "Over DDPQ_SUBMISSIONS_PER_MINUTE; `Retry-After` in seconds"},
    },
)
async def submit(
    request: Request,
    ctx: ContextDep,
    idempotency_key: Annotated[
        str | None,
        Header(
            min_length=1,
            max_length=MAX_IDEMPOTENCY_KEY_CHARS,
            description="A retried POST with the same key and spec returns the same job "
            "(200); the key with another spec is refused (422).",
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        Query(
            description="Validate and answer what would happen (normalised spec, launch "
            "plan, queue explanation) without storing anything: 200 DryRunOut."
        ),
    ] = False,
    job_id: Annotated[
        int | None,
        Query(
            ge=1,
            le=MAX_INT64,
            description="With dry_run: plan the spec as this job's next attempt (its resume "
            "point); the job must be the caller's (an admin's: any).",
        ),
    ] = None,
) -> Response:
    """Validate the spec (every bad field reported at once) and queue it: 201 with the job
    (plus ``warnings``, e.g. no registered worker could ever run it), or 200 with the earlier
    job when ``Idempotency-Key`` was used before for this spec (422 when it was used for
    another). With ``dry_run=true``: 200 with what would happen, nothing stored. With auth
    on and users' code allowed, an owner without a Unix user in ``DDPQ_RANK_USERS`` (nor a
    ``*`` entry) is refused: 422 at ``owner``.

    Caller: any API token (auth on) or anyone (auth off), as for every user route; a dry
    run's ``job_id`` must name one of the caller's jobs (404 otherwise)."""
    # A repeated parameter would be read by its last value: ``?dry_run=true&dry_run=false``
    # would store the job its caller meant to plan.
    repeated = [k for k in ("dry_run", "job_id") if len(request.query_params.getlist(k)) > 1]
    if repeated:
        raise SpecValidationError(
            [
                {
                    "loc": ["query", k],
                    "msg": f"{k} given more than once: give it once",
                    "type": "value_error",
                }
                for k in repeated
            ]
        )
    if job_id is not None and not dry_run:
        raise SpecValidationError(
            [
                {
                    "loc": ["query", "job_id"],
                    "msg": "job_id goes with dry_run=true (plan a job's next attempt)",
                    "type": "value_error",
                }
            ]
        )
    spec = await run_in_threadpool(_validated, await request.body(), ctx.settings)
    # Its ranks run as its owner's Unix user: an owner the map does not cover is refused here,
    # before anything is stored, not at a worker's launch.
    check_submitter(
        ctx.settings.rank_user_map, ctx.caller.owner, required=ctx.settings.rank_users_required
    )
    if dry_run:
        answer = await run_in_threadpool(dry_run_answer, ctx, spec, job_id)
        return json_response(answer, 200)
    # With auth off the one owner is the operator on their own box (a sweep script must not hit
    # 429 at job 61); the per-owner limit is for servers shared through tokens.
    per_minute = ctx.settings.submissions_per_minute if ctx.settings.auth_enabled else None
    submitted = await run_in_threadpool(
        jobs.submit_job,
        ctx.db,
        spec,
        ctx.caller,
        idempotency_key=idempotency_key,
        per_minute=per_minute,
        starting_launcher=ctx.settings.expect_worker,
    )
    if submitted.created:
        claim_waits(request.app).notify()  # a worker's waiting claim takes it at once
    job = SubmittedJobOut(**dict(job_out(submitted.job)), warnings=list(submitted.warnings))
    location = f"{request.url.path.rstrip('/')}/{job.id}"
    return json_response(job, 201 if submitted.created else 200, {"Location": location})


@router.get(
    "/jobs",
    response_model=JobListOut,
    summary="List jobs, newest first",
    responses={304: {"description": "Not modified (If-None-Match)"}, 422: ERRORS[422]},
)
def list_jobs_route(
    request: Request,
    ctx: ContextDep,
    state: Annotated[JobState | None, Query(description="Only jobs in this state.")] = None,
    limit: Annotated[
        int, Query(ge=1, le=MAX_INT64, description="Page size (capped by DDPQ_MAX_LIST_LIMIT).")
    ] = DEFAULT_PAGE_ITEMS,
    cursor: Annotated[
        str | None,
        Query(pattern=r"^[1-9][0-9]{0,17}$", description="``next_cursor`` of the previous page."),
    ] = None,
    q: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=MAX_JOB_NAME_CHARS,
            pattern=TEXT_FILTER_PATTERN,
            description="Only jobs whose name contains this (case-insensitive) or that carry "
            "it as a tag.",
        ),
    ] = None,
    tag: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=MAX_TAG_CHARS,
            pattern=TEXT_FILTER_PATTERN,
            description="Only jobs with exactly this tag.",
        ),
    ] = None,
) -> Response:
    """One page of the caller's jobs; follow ``next_cursor`` until it is null (with the same
    ``state``, ``q`` and ``tag``: the cursor is a job id, the filters are not in it)."""
    found = jobs.list_jobs(
        ctx.db,
        owner=ctx.owner,
        state=state,
        limit=min(limit, ctx.settings.max_list_limit),
        before_id=int(cursor) if cursor is not None else None,
        q=q,
        tag=tag,
    )
    next_id = found.next_before_id
    page = JobListOut(
        jobs=[job_out(j) for j in found.jobs],
        next_cursor=str(next_id) if next_id is not None else None,
    )
    return etag_response(request, page)


@router.get(
    "/jobs/{job_id}",
    response_model=JobOut,
    summary="Get a job",
    responses={304: {"description": "Not modified (If-None-Match)"}, **ERRORS},
)
async def get_job_route(request: Request, job_id: JobIdPath, ctx: ContextDep) -> Response:
    """State, attempt, progress, latest metrics and error of one job; a queued job also
    says why it waits (``queue_reason``, and in detail ``queue``: its place, the jobs ahead —
    other owners' by id and priority only —, which workers could run it), as does a Slurm
    job that Slurm keeps pending (Slurm's reason in plain words)."""

    def read() -> JobOut:
        job = jobs.describe_job(
            ctx.db,
            job_id,
            owner=ctx.owner,
            heartbeat_interval_s=ctx.settings.heartbeat_interval_s,
            max_gpus_per_node=ctx.settings.max_gpus_per_node,
        )
        return job_out(job, queue=job.queue)

    # The hottest route (dashboards and CLIs poll it): a Core read (``describe_job``),
    # retried once on a connection the database closed, in the loop's default executor:
    # anyio's thread hop (FastAPI's for a sync route) cost ~80 µs of CPU against ~30 µs for
    # this.
    job = await asyncio.get_running_loop().run_in_executor(None, read)
    return etag_response(request, job)


@router.post(
    "/jobs/{job_id}/cancel",
    status_code=202,
    response_model=JobOut,
    summary="Cancel a job",
    responses={409: {"description": "The job already finished"}, **ERRORS},
)
def cancel_route(job_id: JobIdPath, ctx: ContextDep) -> Response:
    """A queued job is cancelled at once; a started one gets ``cancel_requested`` and its
    worker stops it. Repeating the call is harmless; a finished job answers 409."""
    return json_response(job_out(jobs.cancel_job(ctx.db, job_id, owner=ctx.owner)), 202)


@router.get(
    "/jobs/{job_id}/events",
    response_model=EventListOut,
    summary="State history of a job",
    responses=ERRORS,
)
def events_route(job_id: JobIdPath, ctx: ContextDep) -> EventListOut:
    """Every state change of the job, oldest first."""
    events = jobs.list_job_events(ctx.db, job_id, owner=ctx.owner)
    return EventListOut(events=[event_out(e) for e in events])
