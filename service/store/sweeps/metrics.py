"""One metric's curves for every trial of a sweep, downsampled per trial in one query."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy import TextClause, bindparam, select, text
from sqlalchemy.orm import Session

from service.store.models import Job, SweepTrial
from service.store.sweeps.values import TrialCurve

# Each trial's current job (``sweep_trials.job_id``) and its first and last point of
# ``:name``: four probes of the metrics primary key per trial, not a scan.
_SPANS = (
    "spans AS (SELECT st.position, st.job_id, st.trial_key, "
    "(SELECT min(m.step) FROM metrics m WHERE m.job_id = st.job_id AND m.name = :name) AS lo, "
    "(SELECT max(m.step) FROM metrics m WHERE m.job_id = st.job_id AND m.name = :name) AS hi, "
    "(SELECT m.value FROM metrics m WHERE m.job_id = st.job_id AND m.name = :name "
    "ORDER BY m.step LIMIT 1) AS lo_value, "
    "(SELECT m.value FROM metrics m WHERE m.job_id = st.job_id AND m.name = :name "
    "ORDER BY m.step DESC LIMIT 1) AS hi_value "
    "FROM sweep_trials st WHERE st.sweep_id = :sweep_id AND st.job_id IS NOT NULL{picked})"
)
# The trials whose curves a page asked for (the best N, the ones its user picked).
_PICKED = " AND st.job_id IN :job_ids"
# Trials short enough to come back whole, and every trial's first and last point. The joins
# of spans to metrics are CROSS JOINs: SQLite keeps that order (each trial's points by the
# primary key) where, after ANALYZE, it chose to scan every point of the table instead.
_WHOLE_AND_ENDS = (
    "SELECT s.position, s.job_id, s.trial_key, m.step, m.value, 0 FROM spans s "
    "CROSS JOIN metrics m WHERE m.job_id = s.job_id AND m.name = :name "
    "AND s.hi - s.lo + 1 <= :max_points "
    "UNION SELECT position, job_id, trial_key, lo, lo_value, 0 FROM spans WHERE lo IS NOT NULL "
    "UNION SELECT position, job_id, trial_key, hi, hi_value, 0 FROM spans WHERE hi IS NOT NULL"
)
# A trial is long when its steps span more than ``:max_points``. The long trials' spans
# together bound the points a min/max pass reads; above ``:budget`` they are sampled
# instead (an index probe per bucket), evaluated once per statement.
_IS_LONG = "s.hi - s.lo + 1 > :max_points"
_LONG_TOTAL = (
    "(SELECT coalesce(sum(s.hi - s.lo + 1), 0) FROM spans s WHERE s.hi - s.lo + 1 > :max_points)"
)
_EXACT = f"{_IS_LONG} AND {_LONG_TOTAL} <= :budget"
_SAMPLED = f"{_IS_LONG} AND {_LONG_TOTAL} > :budget"
# The bucket of a point of a long trial: ``:buckets`` equal step widths over [lo, hi]; a
# sample's bucket ``k`` of ``:samples`` starts at this step.
_BUCKET = "(m.step - s.lo) * :buckets / (s.hi - s.lo + 1)"
_SAMPLE_FROM = "s.lo + k * (s.hi - s.lo + 1) / :samples"

# PostgreSQL: per long trial, one index range scan of its points grouped by bucket (a
# LATERAL subquery: no join of every point against the trials); ``min(ARRAY[value, step])``
# is the (value, step) of the bucket's smallest value (arrays compare element by element),
# so the extremes keep their own steps without a sort. NaN is stored as NULL: left out.
# Sampled trials: the first point at or after each bucket's start, one probe each. (The
# statements of both dialects are built by ``_statements`` below.)
# SQLite: a query with a single min() or max() takes its bare columns (here the step) from
# the row holding that extreme, so the minima and the maxima are a grouped query each. The
# points are a derived table in each, not a shared CTE: SQLite would write the shared one
# (every point of the sweep) to a temporary table first. Samples: two probes of the primary
# key for each bucket's first point (its step, its value), as scalar subqueries: joined back
# to metrics instead, SQLite built a temporary index over every point of the metric.
_SQLITE_POINTS = (
    f"(SELECT s.position, s.job_id, s.trial_key, m.step, m.value, {_BUCKET} AS bucket "
    "FROM spans s CROSS JOIN metrics m WHERE m.job_id = s.job_id AND m.name = :name "
    f"AND {_EXACT} AND m.value IS NOT NULL) AS p"
)
_SQLITE_PROBE = (
    f"FROM metrics m WHERE m.job_id = s.job_id AND m.name = :name AND m.step >= {_SAMPLE_FROM} "
    "ORDER BY m.step LIMIT 1)"
)
_SQLITE_SAMPLES = (
    f"SELECT s.position, s.job_id, s.trial_key, (SELECT m.step {_SQLITE_PROBE}, "
    f"(SELECT m.value {_SQLITE_PROBE}, 1 FROM spans s, samples WHERE {_SAMPLED}"
)


def _statements(picked: bool) -> dict[str, TextClause]:
    """The curves statement by dialect, of every trial or only of the ``:job_ids`` ones."""
    spans = _SPANS.format(picked=_PICKED if picked else "")
    pg = (
        f"WITH {spans} "
        "SELECT s.position, s.job_id, s.trial_key, x.step, x.value, 0 FROM spans s "
        "CROSS JOIN LATERAL (SELECT "
        "min(ARRAY[m.value, m.step]) FILTER (WHERE m.value IS NOT NULL) AS low, "
        "max(ARRAY[m.value, m.step]) FILTER (WHERE m.value IS NOT NULL) AS high "
        "FROM metrics m WHERE m.job_id = s.job_id AND m.name = :name "
        f"GROUP BY {_BUCKET}) AS e "
        "CROSS JOIN LATERAL (VALUES (CAST(e.low[2] AS bigint), e.low[1]), "
        "(CAST(e.high[2] AS bigint), e.high[1])) AS x(step, value) "
        f"WHERE {_EXACT} AND x.step IS NOT NULL "
        "UNION SELECT s.position, s.job_id, s.trial_key, x.step, x.value, 1 FROM spans s "
        "CROSS JOIN LATERAL generate_series(0, :samples - 1) AS g(k) "
        "CROSS JOIN LATERAL (SELECT m.step, m.value FROM metrics m "
        f"WHERE m.job_id = s.job_id AND m.name = :name AND m.step >= {_SAMPLE_FROM} "
        f"ORDER BY m.step LIMIT 1) AS x WHERE {_SAMPLED} "
        f"UNION {_WHOLE_AND_ENDS} ORDER BY 1, 4"
    )
    sqlite = (
        f"WITH RECURSIVE {spans}, "
        "samples(k) AS (SELECT 0 UNION ALL SELECT k + 1 FROM samples WHERE k + 1 < :samples) "
        f"SELECT position, job_id, trial_key, step, min(value), 0 FROM {_SQLITE_POINTS} "
        "GROUP BY job_id, bucket "
        f"UNION SELECT position, job_id, trial_key, step, max(value), 0 FROM {_SQLITE_POINTS} "
        "GROUP BY job_id, bucket "
        f"UNION {_SQLITE_SAMPLES} "
        f"UNION {_WHOLE_AND_ENDS} ORDER BY 1, 4"
    )
    built = {"postgresql": text(pg), "sqlite": text(sqlite)}
    if picked:
        built = {k: v.bindparams(bindparam("job_ids", expanding=True)) for k, v in built.items()}
    return built


_CURVES = {False: _statements(False), True: _statements(True)}


# Points a request may read for exact min/max curves, by dialect; longer sweeps are sampled
# until per-bucket aggregates are kept at write time. PostgreSQL reads them index-only
# (~0.3 s per million on a 2-core box); SQLite's metrics index holds no values, so each
# point of trials that reported interleaved costs a table page (~3.5 s per million).
MAX_SCANNED_POINTS = {"postgresql": 2_000_000, "sqlite": 200_000}


def sweep_curves(
    session: Session,
    sweep_id: int,
    name: str,
    *,
    max_points: int,
    max_scanned_points: int | None = None,
    job_ids: Sequence[int] | None = None,
) -> list[TrialCurve]:
    """The history of metric ``name`` of each trial of ``sweep_id`` (its current job), each
    in at most ``max_points`` points, in trial order; trials without a job or without a point
    of ``name`` are left out. The caller checks that the sweep is the caller's.

    Per trial as ``metrics.downsample_points`` does for one job (M4-style min/max
    decimation): a trial whose steps span ``max_points`` or fewer comes back whole; a longer
    one keeps its first and last point and, in each of ``(max_points - 2) // 2`` equal-width
    step buckets, the points holding the bucket's smallest and largest value, so spikes and
    the extremes survive (a NaN survives only in a trial that comes back whole). All trials
    in one statement, so 100 trials cost one round trip and one pass over their points.

    That pass reads every point of the long trials. When their steps span more than
    ``max_scanned_points`` in all, the long trials are sampled instead (``sampled``): the
    first and last point and the first point of each of ``max_points - 2`` equal step
    buckets, one index probe each, so the cost no longer grows with the history (100 trials
    × 100k points), but a spike between two samples does not show.

    Args:
        max_points: points per trial (≥ 4).
        max_scanned_points: the most points read for exact min/max curves (default:
            ``MAX_SCANNED_POINTS`` of the session's dialect).
        job_ids: only the trials whose current job is one of these (None: every trial);
            an id of no trial of the sweep is ignored.
    Raises:
        ValueError: ``max_points`` below 4.
    """
    if max_points < 4:
        raise ValueError(f"max_points must be at least 4, not {max_points}")
    dialect = session.get_bind().dialect.name
    budget = MAX_SCANNED_POINTS.get(dialect, MAX_SCANNED_POINTS["sqlite"])
    params = {
        "sweep_id": sweep_id,
        "name": name,
        "max_points": max_points,
        "buckets": (max_points - 2) // 2,
        "samples": max_points - 2,
        "budget": budget if max_scanned_points is None else max_scanned_points,
    }
    statements = _CURVES[job_ids is not None]
    if job_ids is not None:
        if not job_ids:
            return []
        params["job_ids"] = list(job_ids)
    if dialect != "postgresql":
        return _curves(session.execute(statements["sqlite"], params).all())
    # A million points cost enough for PostgreSQL to JIT-compile the statement: ~0.4 s of
    # compiling for a query that runs in less. Read sessions run in autocommit (no SET
    # LOCAL), so the setting is put back on the pooled connection at once.
    session.execute(text("SET jit = off"))
    try:
        rows = session.execute(statements["postgresql"], params).all()
    finally:
        session.execute(text("RESET jit"))
    return _curves(rows)


def _curves(rows: Sequence[Any]) -> list[TrialCurve]:
    """``(position, job_id, trial_key, step, value, sampled)`` rows ordered by (position,
    step) as one curve per job; a step listed twice (a bucket's minimum that is also an end,
    a sample that is the first point) once."""
    curves: list[TrialCurve] = []
    steps: list[int] = []
    values: list[float | None] = []
    for _position, job_id, trial_key, step, value, sampled in rows:
        if not curves or curves[-1].job_id != job_id:
            steps, values = [], []
            curves.append(TrialCurve(job_id, trial_key, steps, values, bool(sampled)))
        elif sampled and not curves[-1].sampled:
            curves[-1] = replace(curves[-1], sampled=True)
        if steps and steps[-1] == step:
            continue
        steps.append(int(step))
        values.append(None if value is None else float(value))
    return curves


def sweep_metric_names(session: Session, sweep_id: int) -> list[str]:
    """Names of the metrics any trial of ``sweep_id`` (its current job) has reported, sorted.

    Read from each job's ``latest_metrics`` (one row per trial), not from its points: a
    distinct over every point of 100 long trials would read them all.
    """
    latest = session.scalars(
        select(Job.latest_metrics)
        .join(SweepTrial, SweepTrial.job_id == Job.id)
        .where(SweepTrial.sweep_id == sweep_id)
    )
    return sorted({name for entry in latest if isinstance(entry, dict) for name in entry})
