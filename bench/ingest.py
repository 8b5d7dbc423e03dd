"""Benchmark #6: points/s into PostgreSQL from 4 writers vs plain INSERTs and COPY: via
``record_metrics`` at fixed batch sizes (the direct-database writer), and via the real rank-0
sink of 4 jobs at once, posting to one live ``ddpq serve`` (the attempt API)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from bench.common import (
    PG_URL,
    BenchResult,
    active_jobs,
    attempt_token,
    cli_main,
    median,
    migrated,
    pg_schema,
    pick,
    rank_environ,
    ratio,
    serve_api,
)

WRITERS = 4
GOAL_POINTS_PER_S = 50_000.0
GOAL_RATIO = 0.3
# The sink through the API against the direct-database writer at the sink's batch size.
GOAL_SINK_VS_DIRECT = 0.5
COLUMNS = "job_id, name, step, attempt, epoch, value, time"
# The anchors: no fencing, no duplicate check, no job update, one COMMIT per batch. The ceiling
# is the faster of the two per batch size (COPY usually wins on big batches).
ANCHORS = ("plain", "copy")
# The sink mode's metric name: its rows are counted apart from the other modes' (same steps).
SINK_NAME = "sink"
_start: Any = None  # the sink mode's start barrier, set in each pool process (_init)


def _init(barrier: Any) -> None:
    global _start
    _start = barrier


def _sink_job(args: tuple[str, str, int, int, int]) -> tuple[float, float, int]:
    """One job's rank 0 as ``worker.runtime.main`` builds it (``make_sink`` from its rank
    environment: an ApiSink posting to the attempt API) and the Trainer drives it
    (``report``, ``flush_due``/``time_due`` → ``flush`` with progress, a last ``flush``,
    ``close``), reporting ``points`` points as fast as it can after a barrier.

    Returns:
        (first report, sink closed) on the monotonic clock in seconds (comparable across
        processes), and the points the sink says the API accepted.
    """
    api_url, token, job_id, step0, points = args
    import torch

    from worker.runtime.metrics.buffer import Progress
    from worker.runtime.metrics.sink import ApiSink, make_sink
    from worker.runtime.topology import RankEnv

    last = step0 + points
    with tempfile.TemporaryDirectory(prefix="ddpq-bench-sink-") as artifacts:
        env = RankEnv.from_environ(rank_environ(job_id, api_url, token))
        sink = make_sink(env, None, artifact_dir=Path(artifacts))
        assert isinstance(sink, ApiSink)
        sink.client.self_check()  # connect outside the timed part, as the other modes do
        loss = torch.tensor(0.5)
        _start.wait(timeout=300)
        t0 = time.monotonic()
        for step in range(step0 + 1, last + 1):
            sink.report(step, 0, loss, SINK_NAME)
            if sink.flush_due() or sink.time_due():
                sink.flush(Progress(step, last, 0, None, None))
        sink.flush(Progress(last, last, 0, None, None))
        sink.close()
        t1 = time.monotonic()
    return t0, t1, int(sink.written)


def _count_rows(conninfo: str, schema: str, name: str) -> int:
    with psycopg.connect(conninfo, options=f"-csearch_path={schema}") as conn:
        row = conn.execute("SELECT count(*) FROM metrics WHERE name = %s", (name,)).fetchone()
    return int(row[0]) if row else 0


def _writer(args: tuple[str, Any, int, int, int, int]) -> float:
    """One writer process: ``batches`` batches of ``batch`` points; returns its seconds."""
    mode, url, job_id, step0, batches, batch = args
    from service.core.metrics.points import MetricPoint, checked_point
    from service.store.db import Database
    from service.store.metrics.points import record_metrics
    from service.store.models import utcnow

    if mode == "ddpq":
        db = Database.from_url(url)
        with db.session() as session:  # connect and warm up outside the timed part
            record_metrics(session, job_id, 1, [])
        t0 = time.perf_counter()
        for b in range(batches):
            now = utcnow()
            points = [  # checked in the timed part, as the rank-0 sink does before a write
                checked_point(MetricPoint("loss", step0 + b * batch + i, 0.5, 0, now))
                for i in range(1, batch + 1)
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
    """Points/s with 4 writer processes, interleaved per rep: ``record_metrics`` at fixed
    batches vs plain batched INSERT and COPY; then 4 jobs' rank-0 sinks (``sink``) vs the
    anchors at the sink's flush size (``FLUSH_EVERY_POINTS``).

    Raises:
        RuntimeError: the sinks' rows in the table differ from the points they reported.
    """
    from worker.runtime.metrics.buffer import FLUSH_EVERY_POINTS

    batch_sizes: list[int] = pick(size, [50], [50, 1000])
    total_points = pick(size, 2_000, 5_000, 40_000)  # per writer per repetition
    sink_points = pick(size, 2_000, 20_000, 40_000)  # per job per repetition (sink mode)
    reps = pick(size, 2, 3)
    res = BenchResult("ingest", size)
    schema_pg_url = PG_URL.replace("postgresql+psycopg://", "postgresql://")
    workdir = Path(tempfile.mkdtemp(prefix="ddpq-bench-ingest-"))
    # The stack holds the attempt API, started once the schema is migrated, stopped before
    # the schema is dropped.
    with pg_schema() as url, contextlib.ExitStack() as stack:
        schema = url.split("search_path%3D", 1)[1]
        db = migrated(url)  # before the server starts: it refuses an unmigrated database
        jobs = active_jobs(db, WRITERS)
        tokens = {j: attempt_token(db, j) for j in jobs}
        db.dispose()
        api_url = stack.enter_context(serve_api(url, workdir))
        ctx = mp.get_context("spawn")
        rates: dict[str, list[float]] = {}
        step0 = 0
        with ctx.Pool(WRITERS, initializer=_init, initargs=(ctx.Barrier(WRITERS),)) as pool:
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
            flush = FLUSH_EVERY_POINTS
            batches = max(1, sink_points // flush)
            written = 0
            for _ in range(reps):
                argv_sink = [(api_url, tokens[j], j, step0, sink_points) for j in jobs]
                spans = pool.map(_sink_job, argv_sink)
                wall = max(t1 for _, t1, _ in spans) - min(t0 for t0, _, _ in spans)
                rates.setdefault("sink", []).append(WRITERS * sink_points / wall)
                written += sum(w for _, _, w in spans)
                step0 += sink_points + 1
                for mode in ("ddpq", *ANCHORS):  # ddpq: the direct-database writer
                    target = url if mode == "ddpq" else (schema_pg_url, schema)
                    argv = [(mode, target, j, step0, batches, flush) for j in jobs]
                    wall = max(pool.map(_writer, argv))
                    rates.setdefault(f"{mode}_b{flush}", []).append(
                        WRITERS * batches * flush / wall
                    )
                step0 += max(sink_points, batches * flush) + 1
        counted = _count_rows(schema_pg_url, schema, SINK_NAME)
    if counted != reps * WRITERS * sink_points:
        raise RuntimeError(
            f"sink mode: {counted} rows in the table, {reps * WRITERS * sink_points} reported "
            f"({written} written by the sinks' own count)"
        )
    res.figures = {
        "writers": WRITERS,
        "points_per_writer_per_rep": total_points,
        "sink_points_per_job_per_rep": sink_points,
        "sink_rows_counted": counted,
        "reps": reps,
        "points_per_s_median": {k: round(median(v)) for k, v in rates.items()},
    }
    # (who, its rates, the anchors' batch size, its goals' label): the sink next to b50/b1000.
    series = [("ddpq", f"ddpq_b{b}", b, f"b{b}") for b in batch_sizes]
    for who, key, batch, goal in [*series, ("sink", "sink", flush, "sink")]:
        ours = median(rates[key])
        ceiling = max(median(rates[f"{a}_b{batch}"]) for a in ANCHORS)
        res.ratios[f"{who}_vs_plain_b{batch}"] = ratio(ours, median(rates[f"plain_b{batch}"]))
        res.ratios[f"{who}_vs_ceiling_b{batch}"] = ratio(ours, ceiling)
        res.goals[f"{goal}>=50k/s"] = ours >= GOAL_POINTS_PER_S
        res.goals[f"{goal}>=0.3_ceiling"] = ours / ceiling >= GOAL_RATIO
    direct = median(rates[f"ddpq_b{flush}"])
    res.ratios[f"sink_vs_direct_b{flush}"] = ratio(median(rates["sink"]), direct)
    res.goals["sink>=0.5_direct"] = median(rates["sink"]) / direct >= GOAL_SINK_VS_DIRECT
    res.notes.append(
        "rate = all points ÷ the slowest writer's seconds (connect excluded); "
        "b50 = a small flush (the first report, a time-rule flush of a slow job), b1000 = a "
        "backlog batch (WRITE_BATCH_POINTS; a count-rule flush is FLUSH_EVERY_POINTS = 500); "
        "plain = psycopg executemany + COMMIT, copy = psycopg COPY FROM STDIN + COMMIT; "
        "ceiling = the faster of the two (the 0.3 goal is against it); "
        "sink = 4 jobs' rank-0 ApiSink (make_sink) posting to one `ddpq serve` process "
        "(the attempt API, HTTP/1.1 keep-alive), each reporting "
        "sink_points_per_job_per_rep points as the Trainer does (flush every "
        "FLUSH_EVERY_POINTS, then close), rate = all points ÷ (last sink closed − first "
        "report), rows counted in the table; its anchors run at batch FLUSH_EVERY_POINTS, "
        "with ddpq_b<flush> = the direct-database writer (record_metrics) at that size"
    )
    return res


def main() -> None:
    """CLI: ``python -m bench.ingest --size tiny``."""
    cli_main(run, __doc__ or "")


if __name__ == "__main__":
    main()
