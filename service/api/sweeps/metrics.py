"""Routes of a sweep's metrics: one metric's curves of all its trials, and the names.

Who may call: any caller with a user API token (or anyone with auth off), on their own
sweeps only; an admin on every sweep. Someone else's sweep is 404 (its existence does not
leak), an attempt token 401 (``deps.get_context``), as for jobs.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, Field

from service.api.deps import REQUIRE_CALLER, UNAUTHORIZED, ContextDep
from service.api.sweeps.routes import ERRORS, MAX_INT64, SweepIdPath
from service.core.limits import MAX_METRIC_NAME_CHARS
from service.core.metrics.points import json_safe
from service.store.sweeps import service as sweeps
from service.store.sweeps.values import TrialCurve

router = APIRouter(tags=["sweeps"], dependencies=[REQUIRE_CALLER], responses=UNAUTHORIZED)

# Points per trial when the caller does not say: 100 overlaid curves of 200 points each draw
# as fast as one chart can, and a bucket is still narrower than a pixel column or two.
DEFAULT_POINTS_PER_TRIAL = 200
# Trials one request may pick by job id: a page's best N plus what its user ticked.
MAX_PICKED_TRIALS = 200
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: ERRORS[404]}


class TrialSeriesOut(BaseModel):
    """One trial's curve: ``points`` are ``[step, value]`` pairs, ascending by step; a value
    is null for NaN and "Infinity"/"-Infinity" for ±inf. ``sampled``: the sweep's long
    histories were too long to read whole, so this one is each bucket's first point rather
    than its minimum and maximum (a spike between samples does not show)."""

    job_id: int
    trial_key: str
    sampled: bool
    points: list[tuple[int, float | str | None]]


class SweepMetricsOut(BaseModel):
    """A metric's curves of every trial that reported it, in trial order."""

    name: str
    series: list[TrialSeriesOut]


class SweepMetricNamesOut(BaseModel):
    """Every metric name any trial reported, sorted."""

    names: list[str] = Field(default_factory=list)


def sweep_metrics_json(name: str, curves: list[TrialCurve]) -> bytes:
    """``curves`` as a ``SweepMetricsOut`` body, serialised once (100 trials × 200 points
    validated point by point would cost more than the query)."""
    series: list[dict[str, Any]] = [
        {
            "job_id": c.job_id,
            "trial_key": c.trial_key,
            "sampled": c.sampled,
            "points": [[s, json_safe(v)] for s, v in zip(c.steps, c.values, strict=True)],
        }
        for c in curves
    ]
    return json.dumps({"name": name, "series": series}, allow_nan=False).encode()


@router.get(
    "/sweeps/{sweep_id}/metrics",
    response_model=SweepMetricsOut,
    summary="One metric's curves of all trials",
    responses=NOT_FOUND,
)
def sweep_metrics_route(
    sweep_id: SweepIdPath,
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
    max_points: Annotated[
        int,
        Query(
            ge=4,
            le=MAX_INT64,
            description="Points per trial (capped by DDPQ_MAX_METRIC_POINTS): longer "
            "histories are min/max-decimated so spikes and extremes survive.",
        ),
    ] = DEFAULT_POINTS_PER_TRIAL,
    job_id: Annotated[
        list[Annotated[int, Field(ge=1, le=MAX_INT64)]] | None,
        Query(
            max_length=MAX_PICKED_TRIALS,
            description="Only the trials whose current job is one of these (repeat the "
            f"parameter, at most {MAX_PICKED_TRIALS}); default: every trial.",
        ),
    ] = None,
) -> Response:
    """The whole history of metric ``name`` of each trial's current job (or of the trials
    of ``job_id``: a page's best N and the ones its user picked), downsampled per trial on
    the server (``service.store.sweeps.metrics.sweep_curves``: one query for all trials);
    trials that have not reported it are left out.

    Who may call it: the sweep's owner or an admin (another owner: 404); an attempt or a
    worker token: 401. Bad parameters: 422 naming the field."""
    points = min(max_points, ctx.settings.max_metric_points)
    curves = sweeps.get_sweep_curves(
        ctx.db, sweep_id, name, owner=ctx.owner, max_points=max(4, points), job_ids=job_id
    )
    return Response(sweep_metrics_json(name, curves), media_type="application/json")


@router.get(
    "/sweeps/{sweep_id}/metrics/names",
    response_model=SweepMetricNamesOut,
    summary="Names of the metrics a sweep's trials reported",
    responses=NOT_FOUND,
)
def sweep_metric_names_route(sweep_id: SweepIdPath, ctx: ContextDep) -> SweepMetricNamesOut:
    """Every metric name any trial's current job reported, sorted."""
    names = sweeps.list_sweep_metric_names(ctx.db, sweep_id, owner=ctx.owner)
    return SweepMetricNamesOut(names=names)
