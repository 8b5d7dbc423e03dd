"""Routes of a job's metrics: points since a cursor (polling), downsampled history, names."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response
from fastapi.exceptions import RequestValidationError

from service.api.deps import REQUIRE_CALLER, UNAUTHORIZED, ContextDep
from service.api.http import ERRORS, MAX_INT64, JobIdPath
from service.api.metrics.schemas import (
    HistoryOut,
    MetricNamesOut,
    MetricsOut,
    history_json,
    metrics_json,
)
from service.core.limits import MAX_METRIC_NAME_CHARS, METRIC_PAGE_POINTS
from service.core.metrics.points import MAX_STEP
from service.store.metrics import service as metrics

router = APIRouter(tags=["metrics"], dependencies=[REQUIRE_CALLER], responses=UNAUTHORIZED)


@router.get(
    "/jobs/{job_id}/metrics",
    response_model=MetricsOut | HistoryOut,
    summary="Points of one metric",
    responses=ERRORS,
)
def metrics_route(
    job_id: JobIdPath,
    ctx: ContextDep,
    name: Annotated[
        str,
        Query(
            min_length=1,
            max_length=MAX_METRIC_NAME_CHARS,
            pattern=r"^[^\x00]+$",
            description="Metric.",
        ),
    ] = "loss",
    after_step: Annotated[
        int, Query(ge=0, le=MAX_INT64, description="Only steps after this one.")
    ] = 0,
    limit: Annotated[
        int,
        Query(ge=1, le=MAX_INT64, description="Most points (capped by DDPQ_MAX_METRIC_POINTS)."),
    ] = METRIC_PAGE_POINTS,
    max_points: Annotated[
        int | None,
        Query(
            ge=2,
            le=MAX_INT64,
            description="Downsample the steps from_step..to_step (default: the whole "
            "history) to at most this many points (min/max per bucket, read from the "
            "write-time rollups; ignores after_step and limit).",
        ),
    ] = None,
    from_step: Annotated[
        int,
        Query(ge=1, le=MAX_STEP, description="First step of the range (the chart's zoom)."),
    ] = 1,
    to_step: Annotated[
        int,
        Query(ge=1, le=MAX_STEP, description="Last step of the range (the chart's zoom)."),
    ] = MAX_STEP,
    include_superseded: Annotated[
        bool,
        Query(
            description="Also the points of earlier attempts that a resumed attempt trained "
            "again (marked superseded): both kinds share the page's limit and cursor "
            "(with max_points: both downsampled, each to at most max_points)."
        ),
    ] = False,
) -> Response:
    """Steps after ``after_step`` in ascending order (poll on with ``next_after_step``), or,
    with ``max_points``, the whole history min/max-decimated so spikes and extremes survive.
    Each point names its ``attempt`` and how it was made (``agg``: ``mean`` over ``ranks``
    ranks, or ``rank0``). A step has one current point: after a resume, the resumed attempt's
    (``include_superseded=true`` adds the earlier attempts' points: at most ``limit`` points
    of both kinds per page, ``next_after_step`` continuing through both, so poll new current
    points without it).

    ``from_step``/``to_step`` bound either kind of answer to a step range; a chart zooming
    in asks for its range with ``max_points`` again and gets it re-bucketed (422
    ``to_step`` before ``from_step``).

    Who may call it: the job's owner or an admin (another owner: 404); an attempt token: 401.
    """
    if from_step > to_step:
        raise RequestValidationError(
            [{"type": "value_error", "loc": ("query", "to_step"),
              "msg": f"to_step ({to_step}) is before from_step ({from_step})"}]
        )  # fmt: skip
    page = metrics.read_metric_page(
        ctx.db,
        job_id,
        name,
        owner=ctx.owner,
        after_step=after_step,
        limit=limit,
        max_points=max_points,
        include_superseded=include_superseded,
        cap=ctx.settings.max_metric_points,
        from_step=from_step,
        to_step=to_step,
    )
    if page.superseded is None:
        body = metrics_json(name, page.points, page.next_after_step)
    else:
        body = history_json(name, page.points, page.superseded, page.next_after_step)
    # Serialised once, here: returning a MetricsOut made FastAPI validate every point again.
    return Response(body, media_type="application/json")


@router.get(
    "/jobs/{job_id}/metrics/names",
    response_model=MetricNamesOut,
    summary="Names of a job's metrics",
    responses=ERRORS,
)
def metric_names_route(job_id: JobIdPath, ctx: ContextDep) -> MetricNamesOut:
    """Every metric name the job reported, sorted."""
    return MetricNamesOut(names=metrics.list_metric_names(ctx.db, job_id, owner=ctx.owner))
