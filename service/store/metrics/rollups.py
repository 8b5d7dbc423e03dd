"""Metric rollups: min/max/first/last per step bucket, kept at write time so a chart of a
million-step run reads a few thousand buckets instead of every point.

For each (job, name) and each level k in ``LEVELS`` a bucket holds the current points with
``step >> k == bucket`` (``models.MetricRollup``). The ingest adds a batch's newly stored
points to their buckets in the same transaction (PostgreSQL: inside ``pg_ingest.PG_RECORD``'s
one statement, with the SQL of ``PG_ROLLUP_CTE``; SQLite: ``add_points``); a resume that
supersedes points rebuilds the buckets from its resume step on (``rebuild``), behind the
same attempt fence. ``curves`` reads them.

The order of values is the read-time query's (``points.downsample_points``): NULL (NaN)
after every number, ties to the smaller step; so a bucket's minimum and maximum are the
points that query keeps for the same bucket edges.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import delete, select, text
from sqlalchemy.orm import Session

from service.store.models import Metric, MetricRollup

# Bucket widths 2**k steps. A factor of 8 between levels: a chart range of S steps at B
# buckets reads at most about 8·B rollup rows plus fewer than 2·64 raw points at its edges,
# and a batch of points touches one row per level and bucket.
LEVELS: tuple[int, ...] = (6, 9, 12, 15)

_COLUMNS = (
    "job_id", "name", "level", "bucket", "count", "min_step", "min_value", "max_step",
    "max_value", "first_step", "first_value", "last_step", "last_value",
)  # fmt: skip


def _better_min(new: str, old: str) -> str:
    """SQL: is ``new``'s minimum (NULL after every number, ties to the smaller step) below
    ``old``'s? NULL counts as false in the CASE that uses it."""
    return (
        f"(({old}.min_value IS NULL AND ({new}.min_value IS NOT NULL "
        f"OR {new}.min_step < {old}.min_step)) OR {new}.min_value < {old}.min_value "
        f"OR ({new}.min_value = {old}.min_value AND {new}.min_step < {old}.min_step))"
    )


def _better_max(new: str, old: str) -> str:
    """SQL: is ``new``'s maximum above ``old``'s (NULL after every number, ties to the
    smaller step)?"""
    return (
        f"(({old}.max_value IS NULL AND ({new}.max_value IS NOT NULL "
        f"OR {new}.max_step < {old}.max_step)) OR {new}.max_value > {old}.max_value "
        f"OR ({new}.max_value = {old}.max_value AND {new}.max_step < {old}.max_step))"
    )


def _merge_set() -> str:
    """The ``ON CONFLICT … DO UPDATE SET`` list that adds ``excluded`` (new points' bucket)
    to the stored bucket ``r``; both databases read it alike."""
    lo, hi = _better_min("excluded", "r"), _better_max("excluded", "r")
    first, last = "excluded.first_step < r.first_step", "excluded.last_step > r.last_step"

    def pick(cond: str, col: str) -> str:
        return f"{col} = CASE WHEN {cond} THEN excluded.{col} ELSE r.{col} END"

    return ", ".join(
        ["count = r.count + excluded.count"]
        + [pick(lo, c) for c in ("min_step", "min_value")]
        + [pick(hi, c) for c in ("max_step", "max_value")]
        + [pick(first, c) for c in ("first_step", "first_value")]
        + [pick(last, c) for c in ("last_step", "last_value")]
    )


def _pg_merge_set() -> str:
    """``_merge_set`` in PostgreSQL's shorter spelling, for ``PG_ROLLUP_CTE``: the better of
    two (value, step) pairs is the ``least`` of two float8 arrays (the order of
    ``PG_ROLLUP_CTE``'s aggregates), each bound of the range the ``least``/``greatest`` of
    two steps. The ingest's statement stays under the length psycopg caches its parsed
    form for (``psycopg._queries.MAX_CACHED_STATEMENT_LENGTH``, 4 KiB): parsing it anew
    for every batch cost more than the rest of the batch's client side."""

    def pair(col: str, sign: str) -> str:
        return (f"least(ARRAY[{sign}excluded.{col}_value, excluded.{col}_step], "
                f"ARRAY[{sign}r.{col}_value, r.{col}_step])")  # fmt: skip

    def pick(cond: str, col: str) -> str:
        return f"{col} = CASE WHEN {cond} THEN excluded.{col} ELSE r.{col} END"

    lo, hi = pair("min", ""), pair("max", "-")
    return ", ".join(
        [
            "count = r.count + excluded.count",
            f"min_value = ({lo})[1], min_step = ({lo})[2]",
            f"max_value = -({hi})[1], max_step = ({hi})[2]",
            "first_step = least(excluded.first_step, r.first_step)",
            pick("excluded.first_step < r.first_step", "first_value"),
            "last_step = greatest(excluded.last_step, r.last_step)",
            pick("excluded.last_step > r.last_step", "last_value"),
        ]
    )


_UPSERT_HEAD = f"INSERT INTO metric_rollups AS r ({', '.join(_COLUMNS)}) "
_CONFLICT_KEY = " ON CONFLICT (job_id, name, level, bucket) DO UPDATE SET "
_ON_CONFLICT = _CONFLICT_KEY + _merge_set()

# PostgreSQL: the rollup upsert as a CTE of ``pg_ingest.PG_RECORD``, over the rows its ``ins``
# CTE returned (``name, step, value`` of the points actually inserted): duplicates a resend
# brought add nothing. Plain aggregates over two-element float8 arrays, no sort: an array
# compares element by element and puts NULL after every number, so ``min([value, step])`` is
# the minimum with NULL (NaN) last and ties to the smaller step, ``min([-value, step])`` the
# maximum likewise; steps are exact in float8 (they stay below 2**53). The points are
# aggregated once into the finest level's buckets (``b``), and every level from those:
# min and max of arrays are associative, so a coarser bucket is the same whether built from
# points or from finer buckets, and a batch builds its arrays once per point, not per level.
_FINEST = LEVELS[0]
PG_ROLLUP_CTE = (
    "roll AS (" + _UPSERT_HEAD + "SELECT :job_id, g.name, g.level, g.bucket, g.n, "
    "g.lo[2]::bigint, g.lo[1], g.hi[2]::bigint, -g.hi[1], "
    "g.first[1]::bigint, g.first[2], g.last[1]::bigint, g.last[2] "
    f"FROM (SELECT b.name, l.level, b.k >> (l.level - {_FINEST}) AS bucket, sum(b.n) AS n, "
    "min(b.lo) AS lo, min(b.hi) AS hi, min(b.first) AS first, max(b.last) AS last "
    f"FROM (SELECT i.name, i.step >> {_FINEST} AS k, count(*) AS n, "
    "min(ARRAY[i.value, i.step::float8]) AS lo, min(ARRAY[-i.value, i.step::float8]) AS hi, "
    "min(ARRAY[i.step::float8, i.value]) AS first, max(ARRAY[i.step::float8, i.value]) AS last "
    f"FROM ins AS i GROUP BY 1, 2) AS b "
    "CROSS JOIN unnest(ARRAY[" + ", ".join(map(str, LEVELS)) + "]) AS l(level) "
    "GROUP BY 1, 2, 3) AS g" + _CONFLICT_KEY + _pg_merge_set() + ")"
)
_UPSERT = text(
    _UPSERT_HEAD + "VALUES (" + ", ".join(f":{c}" for c in _COLUMNS) + ")" + _ON_CONFLICT
)


@dataclass(slots=True)
class Bucket:
    """A rollup bucket being built: ``count`` points, the minimum, maximum, first and last
    as (step, value); values None stand for NaN."""

    count: int
    min_step: int
    min_value: float | None
    max_step: int
    max_value: float | None
    first_step: int
    first_value: float | None
    last_step: int
    last_value: float | None

    @classmethod
    def of_point(cls, step: int, value: float | None) -> Bucket:
        """A bucket holding one point."""
        return cls(1, step, value, step, value, step, value, step, value)

    def add(self, other: Bucket) -> None:
        """Fold ``other`` (disjoint steps) into this bucket, in place."""
        self.count += other.count
        if min_key(other.min_value, other.min_step) < min_key(self.min_value, self.min_step):
            self.min_step, self.min_value = other.min_step, other.min_value
        if max_key(other.max_value, other.max_step) < max_key(self.max_value, self.max_step):
            self.max_step, self.max_value = other.max_step, other.max_value
        if other.first_step < self.first_step:
            self.first_step, self.first_value = other.first_step, other.first_value
        if other.last_step > self.last_step:
            self.last_step, self.last_value = other.last_step, other.last_value


def min_key(value: float | None, step: int) -> tuple[bool, float, int]:
    """Sort key of a candidate minimum: numbers ascending, then NULL (NaN), ties by step."""
    return (value is None, 0.0 if value is None else value, step)


def max_key(value: float | None, step: int) -> tuple[bool, float, int]:
    """Sort key of a candidate maximum (the smallest key wins): numbers descending, then
    NULL (NaN), ties by step."""
    return (value is None, 0.0 if value is None else -value, step)


def aggregate(
    points: Iterable[tuple[str, int, float | None]], levels: Sequence[int] = LEVELS
) -> dict[tuple[str, int, int], Bucket]:
    """``(name, step, value)`` points (distinct (name, step)) folded into their buckets at
    each of ``levels`` (ascending): ``{(name, level, bucket): Bucket}``. The finest level
    from the points, each coarser one from the level below (a few buckets per batch)."""
    fine: dict[tuple[str, int], Bucket] = {}
    shift = levels[0]
    for name, step, value in points:
        key = (name, step >> shift)
        b = fine.get(key)
        if b is None:
            fine[key] = Bucket(1, step, value, step, value, step, value, step, value)
            continue
        b.count += 1
        if value is None:
            if b.min_value is None and step < b.min_step:
                b.min_step = step
            if b.max_value is None and step < b.max_step:
                b.max_step = step
        else:
            lo, hi = b.min_value, b.max_value
            if lo is None or value < lo or (value == lo and step < b.min_step):
                b.min_step, b.min_value = step, value
            if hi is None or value > hi or (value == hi and step < b.max_step):
                b.max_step, b.max_value = step, value
        if step < b.first_step:
            b.first_step, b.first_value = step, value
        elif step > b.last_step:
            b.last_step, b.last_value = step, value
    out = {(name, shift, bucket): b for (name, bucket), b in fine.items()}
    below = out
    for prev, k in itertools.pairwise(levels):
        level: dict[tuple[str, int, int], Bucket] = {}
        for (name, _, bucket), child in below.items():
            up = (name, k, bucket >> (k - prev))
            if up in level:
                level[up].add(child)
            else:
                level[up] = replace(child)
        out.update(level)
        below = level
    return out


def _rows(job_id: int, buckets: dict[tuple[str, int, int], Bucket]) -> list[dict[str, Any]]:
    return [
        {"job_id": job_id, "name": name, "level": k, "bucket": bucket, "count": b.count}
        | {"min_step": b.min_step, "min_value": b.min_value, "max_step": b.max_step}
        | {"max_value": b.max_value, "first_step": b.first_step, "first_value": b.first_value}
        | {"last_step": b.last_step, "last_value": b.last_value}
        for (name, k, bucket), b in buckets.items()
    ]


def add_points(
    session: Session, job_id: int, points: Iterable[tuple[str, int, float | None]]
) -> None:
    """Add newly stored ``(name, step, value)`` points (none of them stored before) to job
    ``job_id``'s rollups, in the caller's transaction. The SQLite ingest's half of what
    ``PG_ROLLUP_CTE`` does on PostgreSQL."""
    rows = _rows(job_id, aggregate(points))
    if rows:
        session.connection().execute(_UPSERT, rows)


def rebuild(session: Session, job_id: int, name: str, *, from_step: int = 0) -> None:
    """Recompute ``name``'s rollup buckets that hold steps ≥ ``from_step`` from the current
    points (the finest level from ``metrics``, each coarser one from the level below), in the
    caller's transaction. Reads at most ``2**LEVELS[0]`` points before ``from_step`` and
    every point after it.

    Called after points moved out of ``metrics`` (a resume superseding later steps) and for
    data written around the ingest (tests, benchmark seeds); ``from_step=0``: every bucket.
    """
    prev: int | None = None
    for k in LEVELS:
        start = (from_step >> k) << k  # the first bucket that holds a step ≥ from_step
        where = (MetricRollup.job_id == job_id, MetricRollup.name == name)
        session.execute(delete(MetricRollup).where(*where, MetricRollup.level == k,
                                                   MetricRollup.bucket >= start >> k))  # fmt: skip
        built: dict[tuple[str, int, int], Bucket]
        if prev is None:
            raw = session.execute(
                select(Metric.step, Metric.value).where(
                    Metric.job_id == job_id, Metric.name == name, Metric.step >= start
                )
            )
            built = aggregate(((name, int(s), v) for s, v in raw), (k,))
        else:
            built = {}
            r = MetricRollup
            children = session.execute(
                select(*(getattr(r, c) for c in _COLUMNS[3:])).where(
                    *where, r.level == prev, r.bucket >= start >> prev
                )
            )
            for row in children:
                child = Bucket(*row[1:])
                key = (name, k, int(row.bucket) >> (k - prev))
                if key in built:
                    built[key].add(child)
                else:
                    built[key] = child
        rows = _rows(job_id, built)
        if rows:
            session.connection().execute(_UPSERT, rows)
        prev = k


def rebuild_job(session: Session, job_id: int) -> None:
    """Every rollup of job ``job_id`` recomputed from its current points (``rebuild`` of
    each name), in the caller's transaction."""
    names = session.scalars(select(Metric.name).where(Metric.job_id == job_id).distinct())
    session.execute(delete(MetricRollup).where(MetricRollup.job_id == job_id))
    for name in list(names):
        rebuild(session, job_id, name)
