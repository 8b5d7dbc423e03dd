"""The metric quotas of one job: distinct names (``DDPQ_METRIC_NAMES_PER_JOB``) and points
stored per minute (``DDPQ_METRIC_POINTS_PER_MINUTE``), decided from the job's row inside the
ingest's one statement (``points.record_metrics``): ``jobs.latest_metrics`` holds one entry
per name with a current point, and ``jobs.metric_window_at`` / ``metric_window_points`` the
current window (it starts at the first point stored after the previous one ended), so the
count holds across API processes with no extra round trip.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.core.owners.quotas import (
    METRIC_NAMES_SETTING,
    METRIC_POINTS_SETTING,
    MetricQuotas,
    QuotaExceededError,
    QuotaHit,
)
from service.store.models import Job

# The rate's window (seconds): DDPQ_METRIC_POINTS_PER_MINUTE counts points per window.
RATE_WINDOW_S = 60


def window_start(now: datetime) -> datetime:
    """Where the rate window that holds ``now`` may begin at the earliest."""
    return now - timedelta(seconds=RATE_WINDOW_S)


def quota_refusal(
    quotas: MetricQuotas,
    *,
    stored_names: int,
    new_names: int,
    window_points: int,
    window_at: datetime | None,
    n: int,
    now: datetime,
    stored_of_batch: Callable[[], Iterable[str]],
) -> QuotaExceededError | None:
    """The refusal of a batch of ``n`` points bringing ``new_names`` names not yet stored
    (``stored_names`` are), into a window holding ``window_points`` since ``window_at``;
    None when it fits. ``stored_of_batch`` gives the batch's names the job already has; it is
    called only for the name quota's refusal, which carries them to the rank."""
    if new_names and stored_names + new_names > quotas.max_names:
        hit = QuotaHit("metric names per job", quotas.max_names, stored_names + new_names,
                       METRIC_NAMES_SETTING, "names")  # fmt: skip
        return QuotaExceededError(hit, status_code=422, stored_names=list(stored_of_batch()))
    if n and window_points + n > quotas.per_minute:
        hit = QuotaHit("metric points per job per minute", quotas.per_minute,
                       window_points + n, METRIC_POINTS_SETTING, "points")  # fmt: skip
        left_s = float(RATE_WINDOW_S)
        if window_at is not None:
            left_s = (window_at + timedelta(seconds=RATE_WINDOW_S) - now).total_seconds()
        # Clamped: another API host's clock may run ahead of ours.
        retry_s = min(RATE_WINDOW_S, max(1, math.ceil(left_s)))
        return QuotaExceededError(hit, status_code=429, retry_after_s=retry_s)
    return None


def latest_metrics(session: Session, job_id: int) -> dict[str, Any]:
    """The job's ``latest_metrics`` (one key per name the name quota counts); {} if none."""
    latest = session.scalar(select(Job.latest_metrics).where(Job.id == job_id))
    return latest if isinstance(latest, dict) else {}


def names_stored(latest: dict[str, Any], names: Iterable[str]) -> list[str]:
    """Those of ``names`` the job has: keys of its ``latest_metrics``."""
    return [name for name in names if name in latest]


def check_batch_size(n: int, quotas: MetricQuotas) -> None:
    """Raise when a batch of ``n`` points could never fit the rate, however long it waits.

    Raises:
        QuotaExceededError: ``n`` > ``per_minute`` (422: send smaller batches).
    """
    if n > quotas.per_minute:
        hit = QuotaHit("metric points per job per minute", quotas.per_minute, n,
                       METRIC_POINTS_SETTING, "points")  # fmt: skip
        raise QuotaExceededError(hit, status_code=422)
