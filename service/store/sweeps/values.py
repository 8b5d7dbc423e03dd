"""The sweep resource's values, as its use cases (``service.store.sweeps.service``) return
them: a sweep, its trials table, a page of sweeps, one metric's curves of its trials."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from service.core.states import TrialOutcome, may_be_best


@dataclass(frozen=True, slots=True)
class SweepInfo:
    """A ``sweeps`` row as shown (attribute names as on the table): ``state`` running |
    succeeded | failed | cancelled; ``spec`` the stored sweep spec (JSON); ``objective``
    ``{metric, mode, at}`` with defaults filled in."""

    id: int
    name: str
    owner: str
    state: str
    stop_reason: str | None
    spec: dict[str, Any]
    objective: dict[str, str]
    max_concurrent: int | None
    max_failed: int | None
    created_at: datetime
    finished_at: datetime | None

    @classmethod
    def of(cls, row: Any) -> SweepInfo:
        """The info of a ``sweeps`` ORM object."""
        return cls(
            row.id, row.name, row.owner, row.state, row.stop_reason, row.spec, row.objective,
            row.max_concurrent, row.max_failed, row.created_at, row.finished_at,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class TrialView:
    """One trial as the API's trials table shows it (newest job per key)."""

    key: str
    position: int
    overrides: dict[str, Any]
    job_id: int | None
    state: str | None
    outcome: str
    attempts: int
    steps_done: int | None
    objective_value: float | None
    run_time_s: float | None
    cancel_requested: bool

    @property
    def may_be_best(self) -> bool:
        """Whether its objective value competes for the sweep's best trial (the one rule,
        ``service.core.states.may_be_best``)."""
        return may_be_best(TrialOutcome(self.outcome), cancel_requested=self.cancel_requested)


@dataclass(frozen=True, slots=True)
class SweepDetail:
    """A sweep with how many trials it has, the best trial so far (None: none has an
    objective value that may count), its trials counted by outcome (every outcome, zeros
    too) and, after an extend or a retry, how many trials it added (else None)."""

    sweep: SweepInfo
    trials_total: int
    best: TrialView | None
    counts: dict[str, int]
    added: int | None = None


@dataclass(frozen=True, slots=True)
class SweepPage:
    """One page of sweeps, newest first; ``next_before_id`` continues it (None: the last)."""

    sweeps: tuple[SweepDetail, ...]
    next_before_id: int | None


@dataclass(frozen=True, slots=True)
class SubmittedSweep:
    """What ``POST /sweeps`` did: the sweep, and whether it is new (False: a replayed
    Idempotency-Key returned the earlier one)."""

    detail: SweepDetail
    created: bool


@dataclass(frozen=True, slots=True)
class TrialCurve:
    """One trial's points of a metric: ``steps`` ascending, ``values`` alike (None for NaN);
    ``sampled``: each bucket's first point, not its min and max (see
    ``service.store.sweeps.metrics.sweep_curves``)."""

    job_id: int
    trial_key: str
    steps: list[int]
    values: list[float | None]
    sampled: bool = False


@dataclass(frozen=True, slots=True)
class TrialQuery:
    """Which rows of a sweep's trials table to return: sorted by column ``sort`` (see
    ``service.core.sweeps.trials.TRIAL_SORT_FIELDS``; missing values last either way),
    ``descending`` or not, from ``offset``, at most ``limit`` (None: all); with
    ``changed_since`` (tz-aware UTC) only the trials whose job changed since then."""

    sort: str = "position"
    descending: bool = False
    offset: int = 0
    limit: int | None = None
    changed_since: datetime | None = None


@dataclass(frozen=True, slots=True)
class TrialPage:
    """A page of a sweep's trials table: ``total`` rows matched the query before paging
    (every trial, or every changed one), ``next_offset`` continues it (None: the last page),
    ``changed_since`` is what the next delta poll sends (an overlapping window: rows may come
    again, dedupe by key)."""

    trials: tuple[TrialView, ...]
    total: int
    offset: int
    next_offset: int | None
    changed_since: datetime
