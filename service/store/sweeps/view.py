"""The read view of a sweep's trials: one row per trial key with its newest job's state,
steps, run time and objective value, a page of them sorted in SQL; the best trial and the
counts by outcome, computed in SQL (``columns``), not over every trial in Python."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from service.core.states import TrialOutcome, trial_outcome
from service.store.models import Job, Sweep, SweepTrial, utcnow
from service.store.sweeps import columns
from service.store.sweeps.values import TrialView

# The columns of a TrialView in ``_columns``; at: best's objective comes after them.
_VIEW_COLUMNS = 12
# The API's counts list every outcome, in this order (the job states, then stopped_early).
OUTCOMES = tuple(o.value for o in TrialOutcome)


def _columns(sweep: Sweep, dialect: str) -> tuple[Any, ...]:
    """The columns a TrialView is made of (``_view``'s order); with ``at: best`` the last
    one is the objective's value, computed in SQL."""
    cols: tuple[Any, ...] = (
        SweepTrial.trial_key,
        SweepTrial.position,
        SweepTrial.overrides,
        SweepTrial.job_id,
        SweepTrial.attempts,
        SweepTrial.outcome,
        Job.state,
        Job.progress,
        Job.latest_metrics,
        Job.started_at,
        Job.finished_at,
        Job.cancel_requested,
    )
    if sweep.objective["at"] == "best":
        cols += (columns.objective(sweep, dialect).label("objective"),)
    return cols


def _keyed(sweep: Sweep, sort: str, dialect: str) -> tuple[tuple[Any, ...], Any]:
    """``_columns`` plus the labelled SQL key of ``sort`` (``columns.sort_key``) to order
    by: at: best's objective column itself when it sorts by the objective, so that the
    aggregate is computed once per row."""
    cols = _columns(sweep, dialect)
    if sort == "objective_value" and len(cols) > _VIEW_COLUMNS:
        return cols, cols[_VIEW_COLUMNS]
    key = columns.sort_key(sweep, sort, dialect).label("sort_key")
    return (*cols, key), key


def _dialect(session: Session) -> str:
    return session.get_bind().dialect.name


def list_trials(
    session: Session,
    sweep: Sweep,
    *,
    changed_since: datetime | None = None,
    sort: str = "position",
    descending: bool = False,
    offset: int = 0,
    limit: int | None = None,
) -> list[TrialView]:
    """Every trial of ``sweep`` in position order, with its newest job's state, steps and
    run time, and its objective (``sweep.objective``: the metric's last value, or its best
    over the job's points for ``at: best``; None until reported or when NaN).

    ``changed_since`` (tz-aware UTC): only the trials whose newest job changed at or after
    it (``jobs.updated_at``: every state change, progress report, cancel flag; a retry's or
    an extension's new job is new), for a delta poll. ``sort`` (one of
    ``columns.SQL_SORTS``), ``descending``, ``offset``, ``limit``: a page of that order, cut
    in SQL (a page of 10,000 trials reads 50 rows): missing values last either way, ties in
    position order, as ``table.sort_trials``.

    Raises:
        ValueError: ``sort`` is not one of ``columns.SQL_SORTS``.
    """
    dialect = _dialect(session)
    # Plain columns, not the SweepTrial entity: building 10,000 ORM objects cost more than
    # the query.
    cols, key = (
        _keyed(sweep, sort, dialect) if sort != "position" else (_columns(sweep, dialect), None)
    )
    stmt: Select[Any] = (
        select(*cols)
        .outerjoin(Job, Job.id == SweepTrial.job_id)
        .where(SweepTrial.sweep_id == sweep.id)
        .offset(offset)
        .limit(limit)
    )
    if key is None:
        stmt = stmt.order_by(SweepTrial.position.desc() if descending else SweepTrial.position)
    else:
        # Selected and ordered by its label: an expensive key (at: best's aggregate) is
        # computed once per row; NULLS LAST puts missing values last either way.
        stmt = stmt.order_by(
            (key.desc() if descending else key.asc()).nulls_last(), SweepTrial.position
        )
    if changed_since is not None:
        stmt = stmt.where(*_changed(sweep, changed_since))
    now = utcnow()
    return [_view(sweep, row, now) for row in session.execute(stmt).all()]


def _view(sweep: Sweep, row: Any, now: datetime) -> TrialView:
    """A row of ``_columns`` (and maybe a sort key after them) as a TrialView."""
    (
        key, position, overrides, job_id, attempts, outcome,
        state, progress, latest, started_at, finished_at, cancel_requested,
    ) = row[:_VIEW_COLUMNS]  # fmt: skip
    if sweep.objective["at"] == "best":
        value = row[_VIEW_COLUMNS]
    else:
        value = _latest_value(latest, sweep.objective["metric"])
    return TrialView(
        key=key,
        position=position,
        overrides=overrides,
        job_id=job_id,
        state=state,
        outcome=trial_outcome(state, outcome).value,
        attempts=attempts,
        steps_done=_int(progress.get("step")) if isinstance(progress, dict) else None,
        objective_value=_finite(value),
        run_time_s=_run_time_s(started_at, finished_at, now),
        cancel_requested=bool(cancel_requested),
    )


def best_trial(session: Session, sweep: Sweep) -> TrialView | None:
    """The sweep's best trial, the one rule every client shows (the API's ``best``): the best
    objective value (max or min by the objective's ``mode``) among the trials that
    ``may_be_best``, the first in position order on a tie; None if none has one. Its
    ``outcome`` says whether it is still running. One row read, in SQL."""
    cols, value = _keyed(sweep, "objective_value", _dialect(session))
    descending = sweep.objective.get("mode", "min") == "max"
    stmt = (
        select(*cols)
        .outerjoin(Job, Job.id == SweepTrial.job_id)
        .where(SweepTrial.sweep_id == sweep.id, columns.may_be_best())
        .order_by((value.desc() if descending else value.asc()).nulls_last(), SweepTrial.position)
        .limit(1)
    )
    row = session.execute(stmt).first()
    if row is None:
        return None
    best = _view(sweep, row, utcnow())
    return best if best.objective_value is not None else None


def outcome_counts(session: Session, sweep: Sweep) -> dict[str, int]:
    """Trials by outcome, every outcome present (zeros too): one GROUP BY."""
    state = columns.outcome()
    stmt = (
        select(state, func.count())
        .select_from(SweepTrial)
        .outerjoin(Job, Job.id == SweepTrial.job_id)
        .where(SweepTrial.sweep_id == sweep.id)
        .group_by(state)
    )
    counts = {str(o): int(n) for o, n in session.execute(stmt).all()}
    return {o: counts.get(o, 0) for o in OUTCOMES}


def _changed(sweep: Sweep, changed_since: datetime) -> tuple[Any, ...]:
    """The filter of the trials whose job changed since ``changed_since``: a range of
    ix_jobs_sweep_id_updated_at (the sweep's jobs by their stamp)."""
    return (Job.sweep_id == sweep.id, Job.updated_at >= changed_since)


def count_trials(session: Session, sweep: Sweep, *, changed_since: datetime | None = None) -> int:
    """How many trials ``list_trials`` would list without a page cut."""
    stmt = (
        select(func.count())
        .select_from(SweepTrial)
        .outerjoin(Job, Job.id == SweepTrial.job_id)
        .where(SweepTrial.sweep_id == sweep.id)
    )
    if changed_since is not None:
        stmt = stmt.where(*_changed(sweep, changed_since))
    return int(session.execute(stmt).scalar_one())


def _latest_value(latest: Any, metric: str) -> Any:
    entry = latest.get(metric) if isinstance(latest, dict) else None
    return entry.get("value") if isinstance(entry, dict) else entry


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    v = float(value)
    return v if v == v and abs(v) != float("inf") else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _run_time_s(started: datetime | None, finished: datetime | None, now: datetime) -> float | None:
    if started is None:
        return None
    return max(0.0, ((finished or now) - started).total_seconds())
