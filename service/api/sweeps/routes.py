"""Routes of the sweep resource: submit, list, get, trials, cancel, retry-failed, extend.

Who may call: any caller with a user API token (or anyone with auth off), on their own
sweeps only; an admin on every sweep. Someone else's sweep is 404, an attempt token 401
(``deps.get_context``), as for jobs.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Header, Path, Query, Response
from pydantic import AwareDatetime

from service.api.bodies import body_doc, json_body
from service.api.deps import REQUIRE_CALLER, UNAUTHORIZED, ContextDep, RequestContext
from service.api.http import MAX_INT64
from service.api.sweeps.schemas import (
    SweepListOut,
    SweepOut,
    TrialListOut,
    sweep_out,
    trial_list_out,
    trials_csv,
)
from service.core.errors import SweepNotFoundError
from service.core.limits import DEFAULT_PAGE_ITEMS, MAX_IDEMPOTENCY_KEY_CHARS, MAX_PAGE_ITEMS
from service.core.owners.rank_users import check_submitter
from service.core.sweeps.spec import SweepExtension, SweepSpec
from service.core.sweeps.trials import TRIAL_SORT_FIELDS, TRIAL_SORT_PATTERN
from service.store.sweeps import service as sweeps
from service.store.sweeps.values import TrialQuery

router = APIRouter(tags=["sweeps"], dependencies=[REQUIRE_CALLER], responses=UNAUTHORIZED)


# An override path is at most a few dotted names (the spec's depth).
MAX_SORT_CHARS = 300
SweepIdPath = Annotated[int, Path(ge=1, le=MAX_INT64, description="Sweep id.")]
ERRORS: dict[int | str, dict[str, str]] = {
    404: {"description": f"No such sweep, or not yours (`code`: {SweepNotFoundError.code})"},
    409: {"description": "The sweep's state does not allow it"},
    422: {
        "description": "Invalid input: `detail` lists {loc, msg, type}; a trial's errors "
        "are at loc [body, trials, <index>, <dotted.field>], an axis whose path no job spec "
        "has once at [body, axes, <path>]"
    },
}


@router.post(
    "/sweeps",
    status_code=201,
    response_model=SweepOut,
    summary="Submit a sweep",
    responses={
        200: {"model": SweepOut, "description": "Replay of an earlier Idempotency-Key"},
        422: ERRORS[422],
        429: {"description": "Over the submission limit"},
    },
    openapi_extra=body_doc(SweepSpec),
)
def submit_sweep_route(
    spec: Annotated[SweepSpec, json_body(SweepSpec)],
    ctx: ContextDep,
    response: Response,
    idempotency_key: Annotated[
        str | None,
        Header(
            min_length=1,
            max_length=MAX_IDEMPOTENCY_KEY_CHARS,
            description="A retried POST with the same key and sweep returns the same sweep "
            "(200); the key with another sweep is refused (422).",
        ),
    ] = None,
) -> SweepOut:
    """Expand the sweep and validate every trial before anything is stored (422 naming the
    trial and the field, nothing stored); then store the sweep and all its trials as queued
    jobs in one transaction. Every trial's ``init_from`` is resolved as ``POST /jobs``
    resolves a job's (a job of the caller's, a committed checkpoint; ``"latest"`` made a
    concrete step). Every trial counts as one job against the owner's rate limit (when auth
    is on: 429 with ``Retry-After`` when they do not fit in the last minute's
    ``DDPQ_SUBMISSIONS_PER_MINUTE``, 422 when there are more trials than that, nothing
    stored); a replayed ``Idempotency-Key`` does not count, and answers 200 with the sweep it
    made (422 when it came with another sweep). With auth on and users' code allowed, an
    owner without a Unix user in ``DDPQ_RANK_USERS`` (nor a ``*`` entry) is refused: 422 at
    ``owner``."""
    check_submitter(
        ctx.settings.rank_user_map, ctx.caller.owner, required=ctx.settings.rank_users_required
    )
    submitted = sweeps.submit_sweep(
        ctx.db,
        spec,
        ctx.caller,
        settings=ctx.settings,
        idempotency_key=idempotency_key,
        per_minute=_per_minute(ctx),
    )
    if not submitted.created:
        response.status_code = 200
    return sweep_out(submitted.detail)


def _per_minute(ctx: RequestContext) -> int | None:
    """The owner's jobs-per-minute limit, None with auth off (as for ``POST /jobs``)."""
    return ctx.settings.submissions_per_minute if ctx.settings.auth_enabled else None


@router.get("/sweeps", response_model=SweepListOut, summary="List sweeps, newest first")
def list_sweeps_route(
    ctx: ContextDep,
    limit: Annotated[
        int, Query(ge=1, le=MAX_PAGE_ITEMS, description="Page size.")
    ] = DEFAULT_PAGE_ITEMS,
    cursor: Annotated[int | None, Query(ge=1, le=MAX_INT64, description="next_cursor.")] = None,
) -> SweepListOut:
    """One page of the caller's sweeps (an admin's: everyone's)."""
    page = sweeps.list_sweeps(
        ctx.db, owner=ctx.owner, limit=min(limit, ctx.settings.max_list_limit), before_id=cursor
    )
    return SweepListOut(sweeps=[sweep_out(s) for s in page.sweeps], next_cursor=page.next_before_id)


@router.get(
    "/sweeps/{sweep_id}",
    response_model=SweepOut,
    summary="Get a sweep",
    responses={404: ERRORS[404]},
)
def get_sweep_route(sweep_id: SweepIdPath, ctx: ContextDep) -> SweepOut:
    """State, counts of trials by outcome, and the best trial so far."""
    return sweep_out(sweeps.describe_sweep(ctx.db, sweep_id, owner=ctx.owner))


@router.get(
    "/sweeps/{sweep_id}/trials",
    response_model=TrialListOut,
    summary="The trials table of a sweep",
    responses={404: ERRORS[404], 422: ERRORS[422], 200: {"content": {"text/csv": {}}}},
)
def trials_route(
    sweep_id: SweepIdPath,
    ctx: ContextDep,
    format: Annotated[Literal["json", "csv"], Query(description="json or csv.")] = "json",
    sort: Annotated[
        str,
        Query(
            pattern=TRIAL_SORT_PATTERN,
            max_length=MAX_SORT_CHARS,
            description="Column to sort by: " + ", ".join(TRIAL_SORT_FIELDS) + ", or "
            "overrides.<dotted.path>. Trials without a value come last either way; ties in "
            "position order.",
        ),
    ] = "position",
    order: Annotated[Literal["asc", "desc"], Query(description="asc or desc.")] = "asc",
    limit: Annotated[
        int | None,
        Query(ge=1, le=MAX_PAGE_ITEMS, description="Page size (default: every trial)."),
    ] = None,
    offset: Annotated[
        int, Query(ge=0, le=MAX_INT64, description="Rows to skip (next_offset).")
    ] = 0,
    changed_since: Annotated[
        AwareDatetime | None,
        Query(
            description="Only trials whose job changed since this time: the changed_since "
            "of the previous answer (a delta poll; rows may repeat, dedupe by key)."
        ),
    ] = None,
) -> Response:
    """One row per trial (newest job per key): key, overrides, job, state, outcome, attempts,
    steps done, objective value, run time; sorted and paged on the server (``sort``,
    ``order``, ``offset``, ``limit``; without them every trial in position order), or with
    ``changed_since`` only the trials whose job changed since then. ``format=csv``: the same
    rows as CSV, one column per override path.

    Who may call it: the sweep's owner or an admin (another owner: 404, as ``GET
    /sweeps/{id}``); an attempt or a worker token: 401. Bad parameters: 422 naming the field.
    """
    query = TrialQuery(
        sort=sort,
        descending=order == "desc",
        offset=offset,
        limit=limit,
        changed_since=changed_since,
    )
    page = sweeps.list_trial_page(ctx.db, sweep_id, query, owner=ctx.owner)
    if format == "csv":
        return Response(trials_csv(page.trials), media_type="text/csv")
    return Response(trial_list_out(page).model_dump_json(), media_type="application/json")


@router.post(
    "/sweeps/{sweep_id}/cancel",
    status_code=202,
    response_model=SweepOut,
    summary="Cancel a sweep",
    responses={404: ERRORS[404], 409: ERRORS[409]},
)
def cancel_sweep_route(sweep_id: SweepIdPath, ctx: ContextDep) -> SweepOut:
    """Queued trials are cancelled at once, running ones get ``cancel_requested``; the
    sweep is ``cancelled``. Repeating it is harmless; a finished sweep answers 409."""
    return sweep_out(sweeps.cancel_sweep(ctx.db, sweep_id, owner=ctx.owner, by=ctx.caller.owner))


@router.post(
    "/sweeps/{sweep_id}/retry-failed",
    response_model=SweepOut,
    summary="Re-run the failed trials",
    responses={404: ERRORS[404], 409: ERRORS[409]},
)
def retry_failed_route(sweep_id: SweepIdPath, ctx: ContextDep) -> SweepOut:
    """A new job for every trial whose newest job failed (same spec and trial key; the
    failed job is kept), continuing from the failed job's own newest checkpoint where it
    has one (``init_from`` it, mode ``full``). ``added`` says how many. The new jobs count
    against the owner's rate limit as ``POST /sweeps``'s trials do (429/422, nothing stored)."""
    return sweep_out(
        sweeps.retry_failed_trials(ctx.db, sweep_id, owner=ctx.owner, per_minute=_per_minute(ctx))
    )


@router.post(
    "/sweeps/{sweep_id}/extend",
    response_model=SweepOut,
    summary="Extend a sweep",
    responses=ERRORS,
    openapi_extra=body_doc(SweepExtension),
)
def extend_route(
    sweep_id: SweepIdPath,
    ext: Annotated[SweepExtension, json_body(SweepExtension)],
    ctx: ContextDep,
) -> SweepOut:
    """Add grid values to existing axes, or raise samples/seeds (new totals): only trials
    whose key the sweep does not hold yet are added (``added``), each validated first. The
    added trials count against the owner's rate limit as ``POST /sweeps``'s do (429/422)."""
    detail = sweeps.extend_sweep(
        ctx.db, sweep_id, ext, ctx.caller, settings=ctx.settings, per_minute=_per_minute(ctx)
    )
    return sweep_out(detail)
