"""Benchmark #6: points/s into PostgreSQL via ``record_metrics`` from 4 writers vs plain INSERTs."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import psycopg

from bench.common import (
    PG_URL,
    BenchResult,
    active_jobs,
    cli_main,
    median,
    migrated,
    pg_schema,
    pick,
    ratio,
)

WRITERS = 4
GOAL_POINTS_PER_S = 50_000.0
GOAL_RATIO = 0.3
COLUMNS = "job_id, name, step, attempt, epoch, value, time"
# The anchors: no fencing, no duplicate check, no job update, one COMMIT per batch. The ceiling
# is the faster of the two per batch size (COPY usually wins on big batches).
ANCHORS = ("plain", "copy")


def _writer(args: tuple[str, Any, int, int, int, int]) -> float:
    """One writer process: ``batches`` batches of ``batch`` points; returns its seconds."""
    mode, url, job_id, step0, batches, batch = args
    from service.db import Database
    from service.metrics import MetricPoint, record_metrics
    from service.models import utcnow

    if mode == "ddpq":
        db = Database.from_url(url)
        with db.session() as session:  # connect and warm up outside the timed part
            record_metrics(session, job_id, 1, [])
        t0 = time.perf_counter()
        for b in range(batches):
            now = utcnow()
            points = [
                MetricPoint("loss", step0 + b * batch + i, 0.5, 0, now) for i in range(1, batch + 1)
            ]
            with db.session(one_statement=True) as session:  # as the rank-0 sink writes
                record_metrics(session, job_id, 1, points)
        elapsed = time.perf_counter() - t0
        db.dispose()
        return elapsed
    conninfo, schema = url
    with psycopg.connect(conninfo, options=f"-csearch_path={schema}") as conn:
        t0 = time.perf_counter()
        for b in range(batches):
            now = utcnow()
            rows = [
                (job_id, mode, step0 + b * batch + i, 1, 0, 0.5, now) for i in range(1, batch + 1)
            ]
            with conn.cursor() as cur:
                if mode == "copy":
                    with cur.copy(f"COPY metrics ({COLUMNS}) FROM STDIN") as copy:
                        for row in rows:
                            copy.write_row(row)
                else:
                    cur.executemany(
                        f"INSERT INTO metrics ({COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s)",
                        rows,
                    )
            conn.commit()
        return time.perf_counter() - t0


def run(size: str) -> BenchResult:
    """Points/s with 4 writer processes, ddpq vs plain batched INSERT, interleaved per rep."""
    batch_sizes: list[int] = pick(size, [50], [50, 1000])
    total_points = pick(size, 2_000, 5_000, 40_000)  # per writer per repetition
    reps = pick(size, 2, 3)
    res = BenchResult("ingest", size)
    schema_pg_url = PG_URL.replace("postgresql+psycopg://", "postgresql://")
    with pg_schema() as url:
        schema = url.split("search_path%3D", 1)[1]
        db = migrated(url)
        jobs = active_jobs(db, WRITERS)
        db.dispose()
        ctx = mp.get_context("spawn")
        rates: dict[str, list[float]] = {}
        step0 = 0
        with ctx.Pool(WRITERS) as pool:
            for batch in batch_sizes:
                batches = max(1, total_points // batch)
                for _ in range(reps):
                    for mode in ("ddpq", *ANCHORS):
                        target: Any = url if mode == "ddpq" else (schema_pg_url, schema)
                        argv = [(mode, target, j, step0, batches, batch) for j in jobs]
                        wall = max(pool.map(_writer, argv))
                        rates.setdefault(f"{mode}_b{batch}", []).append(
                            WRITERS * batches * batch / wall
                        )
                    step0 += batches * batch + 1
    res.figures = {
        "writers": WRITERS,
        "points_per_writer_per_rep": total_points,
        "reps": reps,
        "points_per_s_median": {k: round(median(v)) for k, v in rates.items()},
    }
    for batch in batch_sizes:
        ours = median(rates[f"ddpq_b{batch}"])
        ceiling = max(median(rates[f"{a}_b{batch}"]) for a in ANCHORS)
        res.ratios[f"ddpq_vs_plain_b{batch}"] = ratio(ours, median(rates[f"plain_b{batch}"]))
        res.ratios[f"ddpq_vs_ceiling_b{batch}"] = ratio(ours, ceiling)
        res.goals[f"b{batch}>=50k/s"] = ours >= GOAL_POINTS_PER_S
        res.goals[f"b{batch}>=0.3_ceiling"] = ours / ceiling >= GOAL_RATIO
    res.notes.append(
        "rate = all points ÷ the slowest writer's seconds (connect excluded); "
        "b50 = a small flush (the first report, a time-rule flush of a slow job), b1000 = a "
        "backlog batch (WRITE_BATCH_POINTS; a count-rule flush is FLUSH_EVERY_POINTS = 500); "
        "plain = psycopg executemany + COMMIT, copy = psycopg COPY FROM STDIN + COMMIT; "
        "ceiling = the faster of the two (the 0.3 goal is against it)"
    )
    return res


def main() -> None:
    """CLI: ``python -m bench.ingest --size tiny``."""
    cli_main(run, __doc__ or "")


if __name__ == "__main__":
    main()
