"""Benchmark #5: ``GET /jobs/{id}`` throughput/p99 and a dashboard poll's p99 vs MLflow's read."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text

from bench.common import (
    BenchResult,
    active_jobs,
    cli_main,
    median,
    migrated,
    percentile,
    pg_schema,
    pick,
    ratio,
)
from bench.reporting import import_mlflow
from service.config import Settings
from worker.up import settings_env

GOAL_REQ_PER_S = 1500.0
GOAL_POLL_P99_S = 0.020
GOAL_VS_MLFLOW = 10.0
POLL_POINTS = 1000
LOAD_THREADS = 8


def fill_metrics(db_url: str, rows: int, jobs: int, owner: str) -> tuple[int, int]:
    """Fill ``metrics`` server-side with about ``rows`` rows over ``jobs`` running jobs of
    ``owner``.

    Returns:
        ``(job_id, points)``: the polled job and how many loss points it holds.
    """
    db = migrated(db_url)
    ids = active_jobs(db, jobs, owner=owner)
    per_job = max(POLL_POINTS * 2, rows // jobs)
    with db.session() as session:
        session.execute(
            text(
                "INSERT INTO metrics (job_id, name, step, attempt, epoch, value, time) "
                "SELECT j, 'loss', s, 1, 0, random(), now() "
                "FROM unnest(CAST(:ids AS bigint[])) AS j, generate_series(1, :n) AS s"
            ),
            {"ids": ids, "n": per_job},
        )
    with db.engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE metrics"))
    db.dispose()
    return ids[len(ids) // 2], per_job


def load_get_job(base: str, job_id: int, duration_s: float) -> tuple[float, list[float]]:
    """``LOAD_THREADS`` keep-alive clients GET the job for ``duration_s`` seconds.

    Returns:
        ``(requests_per_s, latencies_s)``.
    """
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.perf_counter() + duration_s

    def client() -> None:
        mine: list[float] = []
        with httpx.Client(base_url=base, timeout=30) as http:
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                http.get(f"/jobs/{job_id}").raise_for_status()
                mine.append(time.perf_counter() - t0)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client) for _ in range(LOAD_THREADS)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(latencies) / (time.perf_counter() - t0), latencies


def mlflow_store(tmp: Path, points: int) -> tuple[Any, str] | None:
    """An MLflow SQLite tracking store holding one run with ``points`` loss points."""
    mlflow = import_mlflow()
    if mlflow is None:
        return None
    from mlflow.entities import Metric as MlMetric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    exp = client.create_experiment("bench")
    run_id = client.create_run(exp).info.run_id
    now = int(time.time() * 1000)
    for start in range(1, points + 1, 1000):
        batch = [MlMetric("loss", 0.5, now, s) for s in range(start, min(points, start + 999) + 1)]
        client.log_batch(run_id, metrics=batch)
    return client, run_id


def run(size: str, *, workdir: Path | None = None) -> BenchResult:
    """Throughput and p99 of GET /jobs/{id}; poll p99 (1,000 points after ``after_step``),
    interleaved with MLflow's ``get_metric_history`` of a run with the same points."""
    rows = pick(size, 20_000, 1_000_000, 10_000_000)
    jobs = pick(size, 4, 100, 1000)
    duration_s = pick(size, 1.5, 10.0)
    polls = pick(size, 10, 50, 200)
    tmp = Path(workdir or tempfile.mkdtemp(prefix="ddpq-bench-"))
    res = BenchResult("api", size)
    with pg_schema() as url:
        job_id, points = fill_metrics(url, rows, jobs, Settings().default_owner)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        settings = Settings(
            home=tmp / ".ddpq", database_url=url, artifact_dir=tmp / "artifacts", port=port
        )
        env = {**os.environ, **settings_env(settings)}
        with open(tmp / "api.log", "ab") as log:
            api = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "--factory", "service.app:create_app",
                 "--host", "127.0.0.1", "--port", str(port), "--no-access-log"],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        base = f"http://127.0.0.1:{port}/api/v1"
        try:
            deadline = time.monotonic() + 90
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("the API did not answer /readyz within 90 s")
                time.sleep(0.2)
            load_get_job(base, job_id, 0.5)  # warm-up
            rps, lat = load_get_job(base, job_id, duration_s)
            ml = mlflow_store(tmp, points)
            poll_s: list[float] = []
            ml_s: list[float] = []
            after = points - POLL_POINTS
            with httpx.Client(base_url=base, timeout=30) as http:
                for _ in range(polls):
                    t0 = time.perf_counter()
                    got = http.get(
                        f"/jobs/{job_id}/metrics",
                        params={"name": "loss", "after_step": after, "limit": POLL_POINTS},
                    )
                    got.raise_for_status()
                    poll_s.append(time.perf_counter() - t0)
                    assert len(got.json()["points"]) == POLL_POINTS
                    if ml is not None:
                        t0 = time.perf_counter()
                        history = ml[0].get_metric_history(ml[1], "loss")
                        ml_s.append(time.perf_counter() - t0)
                        assert len(history) == points
        finally:
            api.terminate()
            api.wait(30)
    poll_p99 = percentile(poll_s, 99)
    res.figures = {
        "metrics_rows": jobs * points,
        "polled_job_points": points,
        "get_job_req_per_s": round(rps, 1),
        "get_job_p50_ms": round(percentile(lat, 50) * 1000, 2),
        "get_job_p99_ms": round(percentile(lat, 99) * 1000, 2),
        "poll_p50_ms": round(median(poll_s) * 1000, 2),
        "poll_p99_ms": round(poll_p99 * 1000, 2),
        "mlflow_history_p50_ms": round(median(ml_s) * 1000, 2) if ml_s else None,
        "mlflow_history_p99_ms": round(percentile(ml_s, 99) * 1000, 2) if ml_s else None,
        "load_threads": LOAD_THREADS,
        "duration_s": duration_s,
    }
    speedup = ratio(median(ml_s), median(poll_s)) if ml_s else None
    res.ratios = {
        "get_job_vs_goal": ratio(rps, GOAL_REQ_PER_S),
        "mlflow_vs_ddpq_poll_p50": speedup,
    }
    res.goals = {
        "get_job>=1500/s": rps >= GOAL_REQ_PER_S,
        "poll_p99<=20ms": poll_p99 <= GOAL_POLL_P99_S,
        ">=10x_faster_than_mlflow": None if speedup is None else speedup >= GOAL_VS_MLFLOW,
    }
    if rows < 10_000_000:
        res.notes.append(f"metrics table of {jobs * points:,} rows, not 10M (use --size full)")
    res.notes.append(
        "one uvicorn process (default CLI flags) on PostgreSQL; load generator = 8 httpx "
        "threads in the bench process; MLflow = get_metric_history on a local SQLite store "
        "(it has no after_step: the whole run history is read)"
    )
    return res


def main() -> None:
    """CLI: ``python -m bench.api --size tiny``."""
    cli_main(run, __doc__ or "")


if __name__ == "__main__":
    main()
