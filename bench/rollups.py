"""Benchmark: a chart of a long run from the write-time rollups vs today's read-time query.

One job holds ``points`` loss points (default 10^6), stored through the real ingest
(``record_metrics``, batches of 1,000) with its rollups. Measured on SQLite and PostgreSQL:

- chart load at 1,000 buckets (``max_points`` 2,002): ``curves.curve`` p50/p99 against
  ``points.downsample_points`` (the read-time min/max query the API used before) on the
  same data; and a zoom (a random tenth of the run) from the rollups;
- ingest cost: points/s of the same batches into a second job through the ingest without
  its rollup work (the statement as it was before rollups), interleaved batch by batch
  with the first job's so a noisy machine moves both alike.

Goals: chart p99 ≤ 50 ms on PostgreSQL and ≤ 100 ms on SQLite; rollups ≥ 20× the read-time
query on SQLite; ingest with rollups ≤ 1.2× the cost without.
"""

from __future__ import annotations

import gc
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import column, text
from sqlalchemy.orm import Session

from bench.common import (
    BenchResult,
    active_jobs,
    cli_main,
    migrated,
    percentile,
    pg_schema,
    pick,
    ratio,
    sqlite_url,
)
from service.core.metrics.points import CheckedPoint, MetricPoint, checked_point
from service.store.db import Database
from service.store.metrics import curves, pg_ingest, rollups
from service.store.metrics import points as ingest
from service.store.metrics.points import downsample_points, record_metrics

BATCH = 1000
CHART_MAX_POINTS = 2002  # (2002 - 2) // 2 = 1,000 buckets (tiny: 100, so rollups are read)
GOAL_P99_S = {"postgresql": 0.050, "sqlite": 0.100}
GOAL_VS_READ_TIME_SQLITE = 20.0
GOAL_INGEST_COST = 1.2


@contextmanager
def _without_rollups() -> Iterator[None]:
    """The ingest as it was before rollups: PostgreSQL's statement without the rollup CTE,
    SQLite's insert without the stored-points check and the rollup upsert."""
    saved = (pg_ingest.PG_RECORD, ingest._unstored, ingest.add_points)
    with_cte = str(saved[0].element)
    without = with_cte.replace(rollups.PG_ROLLUP_CTE + ", ", "")
    assert without != with_cte, "the ingest statement no longer holds PG_ROLLUP_CTE"
    columns = (column(c.name) for c in saved[0].selected_columns)
    pg_ingest.PG_RECORD = text(without).columns(*columns)
    ingest._unstored = lambda session, job_id, points: list(points)
    ingest.add_points = lambda session, job_id, points: None
    try:
        yield
    finally:
        pg_ingest.PG_RECORD, ingest._unstored, ingest.add_points = saved


def _spike(rng: random.Random) -> float:
    return 5.0 if rng.random() < 1e-4 else 0.0


def _batch(start: int, rng: random.Random) -> list[CheckedPoint]:
    return [
        checked_point(MetricPoint("loss", s, 1.0 / s + rng.random() * 0.01 + _spike(rng)))
        for s in range(start, start + BATCH)
    ]


def _send(db: Database, job_id: int, batch: list[CheckedPoint]) -> float:
    t0 = time.perf_counter()
    with db.session(one_statement=True) as s:
        record_metrics(s, job_id, 1, batch)
    return time.perf_counter() - t0


def _timed(db: Database, fn: Callable[[Session], Any], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        with db.session(write=False) as s:
            fn(s)
        out.append(time.perf_counter() - t0)
    return out


def _one(
    dialect: str, url: str, n: int, max_points: int, reps: int, read_time_reps: int
) -> dict[str, Any]:
    db = migrated(url)
    try:
        with_job, without_job = active_jobs(db, 2)
        # As the API process does once started (service.app's lifespan): what lives as long
        # as the process stays out of the collector's full passes, which else land in the
        # chart's p99 (a full pass every ~24 loads here).
        gc.freeze()
        rng = random.Random(7)
        spent = {"with": 0.0, "without": 0.0}
        for start in range(1, n + 1, BATCH):
            batch = _batch(start, rng)
            spent["with"] += _send(db, with_job, batch)
            with _without_rollups():
                spent["without"] += _send(db, without_job, batch)
        if dialect == "postgresql":
            with db.engine.connect() as conn:
                conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE"))
        chart = _timed(db, lambda s: curves.curve(s, with_job, "loss", max_points=max_points), reps)
        zrng = random.Random(11)

        def zoom(s: Session) -> None:
            a = zrng.randint(1, n - n // 10)
            curves.curve(s, with_job, "loss", max_points=max_points, from_step=a,
                         to_step=a + n // 10)  # fmt: skip

        zooms = _timed(db, zoom, reps)
        read_time = _timed(
            db,
            lambda s: downsample_points(s, with_job, "loss", max_points=max_points),
            read_time_reps,
        )
        with db.session(write=False) as s:
            got = curves.curve(s, with_job, "loss", max_points=max_points)
        rows = db.engine.connect()
        try:
            rollup_rows = rows.execute(text("SELECT count(*) FROM metric_rollups")).scalar()
        finally:
            rows.close()
    finally:
        db.dispose()
    return {
        "points": n,
        "max_points": max_points,
        "chart_points": len(got),
        "chart_p50_ms": round(percentile(chart, 50) * 1000, 2),
        "chart_p99_ms": round(percentile(chart, 99) * 1000, 2),
        "zoom_p99_ms": round(percentile(zooms, 99) * 1000, 2),
        "read_time_p50_ms": round(percentile(read_time, 50) * 1000, 1),
        "ingest_points_per_s_with": round(n / spent["with"]),
        "ingest_points_per_s_without": round(n / spent["without"]),
        "rollup_rows": rollup_rows,
    }


def run(size: str, *, workdir: Path | None = None) -> BenchResult:
    """Chart load and ingest cost with rollups, on SQLite and PostgreSQL (a throwaway
    schema)."""
    n = pick(size, 10_000, 1_000_000)
    max_points = pick(size, 202, CHART_MAX_POINTS)
    reps = pick(size, 10, 200)
    read_time_reps = pick(size, 2, 5)
    tmp = Path(workdir or tempfile.mkdtemp(prefix="ddpq-bench-"))
    res = BenchResult("rollups", size)
    with pg_schema() as pg_url:
        for dialect, url in (("sqlite", sqlite_url(tmp)), ("postgresql", pg_url)):
            fig = _one(dialect, url, n, max_points, reps, read_time_reps)
            res.figures[dialect] = fig
            p99_s = fig["chart_p99_ms"] / 1000
            res.ratios[f"{dialect}_chart_p99_vs_goal"] = ratio(p99_s, GOAL_P99_S[dialect])
            res.ratios[f"{dialect}_read_time_vs_rollups"] = ratio(
                fig["read_time_p50_ms"], fig["chart_p50_ms"]
            )
            cost = ratio(fig["ingest_points_per_s_without"], fig["ingest_points_per_s_with"])
            res.ratios[f"{dialect}_ingest_cost_with_vs_without"] = cost
            res.goals[f"{dialect}_chart_p99"] = p99_s <= GOAL_P99_S[dialect]
            res.goals[f"{dialect}_ingest_cost"] = cost is not None and cost <= GOAL_INGEST_COST
    speedup = res.ratios["sqlite_read_time_vs_rollups"]
    res.goals["sqlite_vs_read_time"] = speedup is not None and speedup >= GOAL_VS_READ_TIME_SQLITE
    return res


def main() -> None:
    """CLI: ``python -m bench.rollups --size tiny``."""
    cli_main(run, __doc__ or "")


if __name__ == "__main__":
    main()
