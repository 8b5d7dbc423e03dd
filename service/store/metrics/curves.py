"""A metric's curve over a step range in at most ``max_points`` points, read from the rollup
buckets (``rollups``) instead of every point: the chart's whole-history view and each zoom.

The range's steps are cut into display buckets of 2**d steps (aligned: bucket ``step >> d``),
d the smallest that gives at most ``(max_points - 2) // 2`` buckets over the range. Each
display bucket is covered by aligned rollup buckets of levels ≤ d, and by raw points where
the range's ragged edges are finer than the finest level. The curve keeps the range's first
and last point and each display bucket's minimum and maximum (M4-style min/max decimation,
as ``points.downsample_points`` does at read time: every spike survives), then reads those
points' rows. A range of ``max_points`` or fewer points comes back whole.
"""

from __future__ import annotations

from sqlalchemy import select, text, union_all
from sqlalchemy.orm import Session

from service.core.metrics.points import MAX_STEP
from service.store.metrics.points import POINT_COLUMNS
from service.store.metrics.rollups import LEVELS, Bucket, aggregate
from service.store.metrics.values import PointRow
from service.store.models import Metric, MetricRollup

Runs = dict[int, list[tuple[int, int]]]

# PostgreSQL: the kept points' rows, one primary-key probe per step. The steps travel as one
# array (an IN list of 2,000 parameters cost psycopg ~20 ms to parse), and the LIMIT keeps the
# lateral subquery a probe: as a plain ``step = ANY(…)``, statistics taken before a bulk
# ingest made the planner filter the job's every point instead (~100 ms for 200k points).
_PG_POINTS_AT = text(
    "SELECT m.step, m.epoch, m.value, m.time, m.attempt, m.ranks "
    "FROM unnest(CAST(:steps AS bigint[])) AS s(step) CROSS JOIN LATERAL "
    "(SELECT step, epoch, value, time, attempt, ranks FROM metrics "
    "WHERE job_id = :job_id AND name = :name AND step = s.step LIMIT 1) AS m ORDER BY m.step"
).columns(*POINT_COLUMNS)


def step_bounds(
    session: Session, job_id: int, name: str, from_step: int, to_step: int
) -> tuple[int, int] | None:
    """The first and last step of ``name`` within ``[from_step, to_step]``, or None when it
    has no point there: two index seeks."""
    where = (Metric.job_id == job_id, Metric.name == name, Metric.step.between(from_step, to_step))
    lo = select(Metric.step).where(*where).order_by(Metric.step).limit(1).scalar_subquery()
    hi = select(Metric.step).where(*where).order_by(Metric.step.desc()).limit(1).scalar_subquery()
    first, last = session.execute(select(lo, hi)).one()
    return None if first is None else (int(first), int(last))


def display_shift(lo: int, hi: int, buckets: int) -> int:
    """The smallest d ≥ 0 such that the aligned buckets ``step >> d`` touching ``[lo, hi]``
    number at most ``buckets`` (≥ 1)."""
    d = 0
    while (hi >> d) - (lo >> d) + 1 > buckets:
        d += 1
    return d


def cover(lo: int, hi: int, top: int) -> tuple[Runs, list[tuple[int, int]]]:
    """``[lo, hi]`` as disjoint aligned blocks: ``({level: [(first_bucket, last_bucket)]},
    [(first_step, last_step)])``, rollup levels ≤ ``top`` (coarsest first where aligned) and
    raw step ranges where no level fits. No block crosses a multiple of ``2**top``. Each
    level gets at most two runs and the raw ranges are shorter than ``2**LEVELS[0]``."""
    levels = [k for k in LEVELS if k <= top]
    runs: Runs = {}
    raw: list[tuple[int, int]] = []
    pos = lo
    while pos <= hi:
        for i in range(len(levels) - 1, -1, -1):
            k = levels[i]
            size = 1 << k
            if pos % size or pos + size - 1 > hi:
                continue
            n = (hi - pos + 1) // size
            if i + 1 < len(levels):  # stop where the next coarser level aligns
                coarser = levels[i + 1]
                n = min(n, ((((pos >> coarser) + 1) << coarser) - pos) // size)
            runs.setdefault(k, []).append((pos >> k, (pos >> k) + n - 1))
            pos += n * size
            break
        else:
            end = hi
            if levels:
                end = min(hi, (((pos >> levels[0]) + 1) << levels[0]) - 1)
            raw.append((pos, end))
            pos = end + 1
    return runs, raw


def _raw_points(
    session: Session, job_id: int, name: str, raw: list[tuple[int, int]]
) -> list[tuple[int, float | None]]:
    """``(step, value)`` of ``name``'s points in the step ranges ``raw``: one range scan
    each (as one OR, PostgreSQL filtered the job's every point), fetched at once."""
    parts = [
        select(Metric.step, Metric.value).where(
            Metric.job_id == job_id, Metric.name == name, Metric.step.between(a, b)
        )
        for a, b in raw
    ]
    stmt = parts[0] if len(parts) == 1 else union_all(*parts)
    return [(int(s), v) for s, v in session.connection().execute(stmt).all()]


def _rollups(session: Session, job_id: int, name: str, runs: Runs) -> list[Bucket]:
    """The rollup buckets of ``runs``: one index range scan per run (at most two per
    level)."""
    if not runs:
        return []
    r = MetricRollup
    cols = (r.count, r.min_step, r.min_value, r.max_step, r.max_value, r.first_step,
            r.first_value, r.last_step, r.last_value)  # fmt: skip
    parts = [
        select(*cols).where(
            r.job_id == job_id, r.name == name, r.level == k, r.bucket.between(a, b)
        )
        for k, rs in runs.items()
        for a, b in rs
    ]
    stmt = parts[0] if len(parts) == 1 else union_all(*parts)
    return [Bucket(*row) for row in session.connection().execute(stmt).all()]


def _buckets(
    session: Session, job_id: int, name: str, shift: int, runs: Runs, raw: list[tuple[int, int]]
) -> dict[int, Bucket]:
    """The display buckets (``step >> shift``) made of the rollup buckets of ``runs`` and the
    raw points of ``raw``: ``{display bucket: Bucket}``."""
    merged: dict[int, Bucket] = {}
    if raw:
        folded = aggregate(((name, s, v) for s, v in _raw_points(session, job_id, name, raw)),
                           (shift,))  # fmt: skip
        merged = {bucket: b for (_, _, bucket), b in folded.items()}
    for b in _rollups(session, job_id, name, runs):
        key = b.first_step >> shift
        if key in merged:
            merged[key].add(b)
        else:
            merged[key] = b
    return merged


def curve_steps(
    session: Session, job_id: int, name: str, *, max_points: int, lo: int, hi: int
) -> list[int] | None:
    """The steps the curve of ``[lo, hi]`` (the first and last step there) keeps: ``lo``,
    ``hi`` and each display bucket's minimum and maximum, ascending; None when the range
    holds ``max_points`` points or fewer (then every point is the curve)."""
    if hi - lo + 1 <= max_points:
        return None
    shift = display_shift(lo, hi, max(1, (max_points - 2) // 2)) if max_points >= 4 else 63
    runs, raw = cover(lo, hi, shift)
    merged = _buckets(session, job_id, name, shift, runs, raw)
    if sum(b.count for b in merged.values()) <= max_points:
        return None
    keep = {lo, hi}
    if max_points >= 4:
        for b in merged.values():
            keep.update((b.min_step, b.max_step))
    return sorted(keep)


def curve(
    session: Session,
    job_id: int,
    name: str,
    *,
    max_points: int,
    from_step: int = 1,
    to_step: int = MAX_STEP,
) -> list[PointRow]:
    """``name``'s points in ``[from_step, to_step]`` in at most ``max_points`` (≥ 2) points,
    ascending by step: every point when there are ``max_points`` or fewer, else the first,
    the last and each display bucket's minimum and maximum (see the module doc). Reads at
    most about ``8 · max_points`` rollup rows, fewer than ``2 · 64`` raw points at the
    range's edges, and the kept points' rows."""
    bounds = step_bounds(session, job_id, name, from_step, to_step)
    if bounds is None:
        return []
    lo, hi = bounds
    steps = curve_steps(session, job_id, name, max_points=max_points, lo=lo, hi=hi)
    where = [Metric.job_id == job_id, Metric.name == name]
    if steps is None:
        where.append(Metric.step.between(lo, hi))
    elif session.get_bind().dialect.name == "postgresql":
        params = {"job_id": job_id, "name": name, "steps": steps}
        return list(session.connection().execute(_PG_POINTS_AT, params).all())
    else:
        where.append(Metric.step.in_(steps))
    stmt = select(*POINT_COLUMNS).where(*where).order_by(Metric.step)
    return list(session.connection().execute(stmt).all())
