"""The trials table's computed columns as SQL over ``sweep_trials`` ⟕ ``jobs``, read as
``view`` reads them in Python: the objective's value, steps done, the outcome, whether a
trial may be the best; and the order ``table.sort_trials`` gives the columns SQL orders alike
(``SQL_SORTS``; the others, run time and overrides, are sorted in Python)."""

from __future__ import annotations

import sys
from typing import Any

from sqlalchemy import Numeric, String, and_, case, cast, func, literal_column, not_, or_, select
from sqlalchemy.sql.elements import ColumnElement

from service.core.states import TrialOutcome
from service.store.metrics import rollups
from service.store.models import Job, MetricRollup, Sweep, SweepTrial

# Columns whose SQL order equals ``table.sort_trials``'s (numbers, or outcomes ranked as
# Python orders their text); ties in position order, missing values last either way.
SQL_SORTS = frozenset(
    {"position", "job_id", "attempts", "outcome", "objective_value", "steps_done"}
)

_NUMBER_TYPES = ("integer", "real")  # SQLite's json_type of a JSON number
_MAX = sys.float_info.max


def outcome() -> ColumnElement[str]:
    """SQL of ``trial_outcome``: the recorded outcome unless the newest job succeeded, else
    that job's state, else cancelled (a trial without a job)."""
    # Literals, not bound parameters: GROUP BY repeats the expression, and PostgreSQL
    # matches it with the SELECT's only when it is the same text.
    cancelled = literal_column(f"'{TrialOutcome.CANCELLED.value}'", String)
    succeeded = literal_column(f"'{TrialOutcome.SUCCEEDED.value}'", String)
    recorded_holds = and_(
        SweepTrial.outcome.is_not(None), func.coalesce(Job.state, cancelled) != succeeded
    )
    return case((recorded_holds, SweepTrial.outcome), else_=func.coalesce(Job.state, cancelled))


def _outcome_rank() -> ColumnElement[int]:
    """Outcomes ranked by their text as Python compares strings (code points, whatever the
    database's collation)."""
    ranks = {o: i for i, o in enumerate(sorted(o.value for o in TrialOutcome))}
    return case(ranks, value=outcome())


def may_be_best() -> ColumnElement[bool]:
    """SQL of ``service.core.states.may_be_best`` over a trial's outcome and its job's
    cancel flag (a NULL flag counts as not set, as ``bool(None)`` does)."""
    state = outcome()
    running = and_(
        state == TrialOutcome.RUNNING.value, not_(func.coalesce(Job.cancel_requested, False))
    )
    finished = state.in_((TrialOutcome.SUCCEEDED.value, TrialOutcome.STOPPED_EARLY.value))
    return or_(finished, running)


def objective(sweep: Sweep, dialect: str) -> ColumnElement[Any]:
    """The trial's objective value as ``view.list_trials`` reads it: ``at: best`` the
    minimum or maximum (by ``mode``) of the metric's current points (read from its coarsest
    rollups), NULL when none or not finite; else the metric's entry in ``jobs.latest_metrics``
    (``{"step", "value"}``, or a bare number in rows stored before), NULL unless a JSON number
    (not a bool). Units: the metric's. ``dialect``: ``postgresql`` or ``sqlite``."""
    metric, mode, at = (sweep.objective[k] for k in ("metric", "mode", "at"))
    if at == "best":
        # The coarsest rollups hold every current point's extremes (NaN, stored NULL, ranks
        # after every number, as min()/max() skip it): a trial of a million points is a
        # handful of buckets, not a scan of its points, on every poll of the sweep page.
        extreme = MetricRollup.max_value if mode == "max" else MetricRollup.min_value
        agg = func.max(extreme) if mode == "max" else func.min(extreme)
        # ±inf points are stored as such and the view shows them as None: filtered inside the
        # subquery, so the aggregate is computed once per trial.
        finite = case((agg.between(-_MAX, _MAX), agg))
        return (
            select(finite)
            .where(
                MetricRollup.job_id == SweepTrial.job_id,
                MetricRollup.name == metric,
                MetricRollup.level == rollups.LEVELS[-1],
            )
            .scalar_subquery()
        )
    # No finiteness test here: the ingest writes only finite numbers (json_safe turns ±inf
    # into text), and neither database's JSON reads a non-finite number.
    if dialect == "postgresql":
        entry = Job.latest_metrics[metric]
        nested = Job.latest_metrics[metric]["value"]
        return case(
            (func.json_typeof(entry) == "number", entry.as_float()),
            (func.json_typeof(nested) == "number", nested.as_float()),
        )
    # SQLite: json_each, not a '$."name"' path: a path cannot hold every metric name (a
    # quote, or a character the stored JSON escapes).
    each = func.json_each(Job.latest_metrics).table_valued("key", "value", "type").alias("e")
    inner = case(
        (
            func.json_type(each.c.value, "$.value").in_(_NUMBER_TYPES),
            func.json_extract(each.c.value, "$.value"),
        )
    )
    value = case(
        (each.c.type.in_(_NUMBER_TYPES), each.c.value),
        (each.c.type == "object", inner),
    )
    return select(value).where(each.c.key == metric).limit(1).scalar_subquery()


def steps_done(dialect: str) -> ColumnElement[Any]:
    """``progress.step`` when it is a JSON integer (not 5.0, not a bool), else NULL: the
    view's ``steps_done``."""
    if dialect == "postgresql":
        step = Job.progress["step"]
        text_ = step.as_string()
        return case(
            (
                and_(func.json_typeof(step) == "number", text_.regexp_match("^-?[0-9]+$")),
                cast(text_, Numeric),
            )
        )
    return case(
        (
            func.json_type(Job.progress, "$.step") == "integer",
            func.json_extract(Job.progress, "$.step"),
        )
    )


def sort_key(sweep: Sweep, sort: str, dialect: str) -> ColumnElement[Any]:
    """The SQL value ``sort`` (one of ``SQL_SORTS``) orders by, NULL for a missing value.

    Raises:
        ValueError: ``sort`` is not one of ``SQL_SORTS``.
    """
    keys: dict[str, Any] = {
        "position": SweepTrial.position,
        "job_id": SweepTrial.job_id,
        "attempts": SweepTrial.attempts,
        "outcome": _outcome_rank(),
    }
    if sort in keys:
        return keys[sort]
    if sort == "objective_value":
        return objective(sweep, dialect)
    if sort == "steps_done":
        return steps_done(dialect)
    raise ValueError(f"trials are not sorted by {sort!r} in SQL")
