"""The quotas' vocabulary shared by the API and the store: the limits a deployment sets
(``Settings``' ``*_max_bytes``, ``metric_*``, ``uploads_in_flight_per_owner``), one refused
write (``QuotaHit``: which quota, the limit, the amount asked, the setting to raise) and the
error that carries it to the client. ``service.store.quotas`` measures and decides."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from service.core.config import Settings
from service.core.errors import DdpqError


@dataclass(frozen=True)
class QuotaLimits:
    """The quotas on stored bytes and uploads, as ``Settings`` gives them (bytes; uploads)."""

    checkpoint_job_max_bytes: int
    checkpoint_owner_max_bytes: int
    workspace_owner_max_bytes: int
    uploads_in_flight_per_owner: int

    @classmethod
    def from_settings(cls, settings: Settings) -> QuotaLimits:
        """The deployment's limits."""
        return cls(
            checkpoint_job_max_bytes=settings.checkpoint_job_max_bytes,
            checkpoint_owner_max_bytes=settings.checkpoint_owner_max_bytes,
            workspace_owner_max_bytes=settings.workspace_owner_max_bytes,
            uploads_in_flight_per_owner=settings.uploads_in_flight_per_owner,
        )


@dataclass(frozen=True)
class MetricQuotas:
    """The metric quotas of one batch: ``max_names`` distinct names per job
    (``DDPQ_METRIC_NAMES_PER_JOB``) and ``per_minute`` points per job per window of
    ``RATE_WINDOW_S`` seconds (``DDPQ_METRIC_POINTS_PER_MINUTE``)."""

    max_names: int
    per_minute: int

    @classmethod
    def from_settings(cls, settings: Settings) -> MetricQuotas:
        """The deployment's metric quotas."""
        return cls(
            max_names=settings.metric_names_per_job, per_minute=settings.metric_points_per_minute
        )


@dataclass(frozen=True)
class QuotaHit:
    """One refused write: ``quota`` (its name), ``limit`` and ``asked`` (in ``unit``: "bytes",
    "names", "points", "uploads"; ``asked`` is what the usage would have become), and
    ``setting`` (the ``DDPQ_*`` variable to raise)."""

    quota: str
    limit: int
    asked: int
    setting: str
    unit: str

    def event_data(self) -> dict[str, object]:
        """The ``quota_exceeded`` event's data."""
        return {"quota": self.quota, "limit": self.limit, "asked": self.asked,
                "setting": self.setting, "unit": self.unit}  # fmt: skip

    def words(self) -> str:
        """The refusal as people read it, naming the setting to raise."""
        return (
            f"{self.quota} quota: this needs {self.asked} {self.unit}, the limit is "
            f"{self.limit} {self.unit} ({self.setting}): raise {self.setting}, or free room"
        )


# The settings that raise the metric quotas, as their refusals name them (the rank's sink
# tells the name quota's refusal by this name).
METRIC_NAMES_SETTING = "DDPQ_METRIC_NAMES_PER_JOB"
METRIC_POINTS_SETTING = "DDPQ_METRIC_POINTS_PER_MINUTE"


class QuotaExceededError(DdpqError):
    """A write that would pass a quota; nothing of it was stored. ``status_code`` is the
    answer's (413 for bytes, 422 for metric names, 429 with ``retry_after_s`` for a rate or
    a count of uploads under way).

    ``stored_names`` (the metric-name quota's refusal only): those of the refused batch's
    names the job already has, sorted, answered as the field ``stored_names``, so a rank can
    send again the points that fit (a resumed attempt does not know what earlier ones
    stored) without probing name by name."""

    code = "quota_exceeded"

    def __init__(
        self,
        hit: QuotaHit,
        *,
        status_code: int,
        retry_after_s: float | None = None,
        stored_names: Sequence[str] | None = None,
    ) -> None:
        self.hit = hit
        self.status_code = status_code
        self.retry_after_s = retry_after_s
        self.stored_names = None if stored_names is None else sorted(stored_names)
        words = hit.words()
        if retry_after_s is not None:
            words += f"; retry in {retry_after_s:.0f} s"
        super().__init__(words)

    def answer_fields(self) -> dict[str, Any]:
        """``{"stored_names": [...]}`` for a name-quota refusal; nothing for the others."""
        return {} if self.stored_names is None else {"stored_names": self.stored_names}
