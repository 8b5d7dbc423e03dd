"""Benchmark #5: ``GET /jobs/{id}`` throughput/p99 and a dashboard poll's p99 vs MLflow's read."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import event, text

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
from service.core.config import Settings
from service.store.db import Database
from service.store.metrics.points import query_points
from worker.up import settings_env

GOAL_REQ_PER_S = 1500.0
GOAL_POLL_P99_S = 0.020
GOAL_VS_MLFLOW = 10.0
POLL_POINTS = 1000
LOAD_CONNECTIONS = 8


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


def explain_poll(db_url: str, job_id: int, after_step: int) -> dict[str, Any]:
    """``EXPLAIN (ANALYZE, BUFFERS)`` of the SQL ``query_points`` sends for one poll.

    Returns:
        ``{"scan": the plan's scan line, "heap_fetches": …, "execution_ms": …}``.
    """
    db = Database.from_url(db_url)
    seen: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, sql: str, params: Any, *_: Any) -> None:
        seen.append((sql, params))

    try:
        with db.session(write=False) as session:
            event.listen(db.engine, "before_cursor_execute", capture)
            query_points(session, job_id, "loss", after_step=after_step, limit=POLL_POINTS)
            event.remove(db.engine, "before_cursor_execute", capture)
        sql, params = seen[-1]
        with db.engine.connect() as conn:
            plan = [r[0] for r in conn.exec_driver_sql(f"EXPLAIN (ANALYZE, BUFFERS) {sql}", params)]
    finally:
        db.dispose()
    scan = next((line.strip() for line in plan if "Scan" in line), "?")
    fetches = next((line.split(":")[1].strip() for line in plan if "Heap Fetches" in line), None)
    exec_ms = next((line.split(":")[1].strip() for line in plan if "Execution Time" in line), "?")
    return {"scan": scan.split("  (")[0], "heap_fetches": fetches, "execution": exec_ms}


async def _keep_alive_client(
    host: str, port: int, path: str, stop: float, latencies: list[float]
) -> None:
    """One keep-alive HTTP/1.1 connection sending GET ``path`` until ``stop`` (perf_counter).

    Raises:
        RuntimeError: a response other than 200.
    """
    reader, writer = await asyncio.open_connection(host, port)
    request = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    try:
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
            await reader.readexactly(int(headers.get("content-length", "0")))
            if lines[0].split(" ")[1] != "200":
                raise RuntimeError(f"GET {path}: {lines[0]}")
            latencies.append(time.perf_counter() - t0)
    finally:
        writer.close()


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` and its children (uvicorn's worker
    processes) have used; None where /proc is missing."""
    total = 0.0
    try:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:  # the process ended meanwhile
                continue
            if stat.parent.name == str(pid) or fields[1] == str(pid):  # itself, or a child
                total += int(fields[11]) + int(fields[12])
    except OSError:
        return None
    return total / os.sysconf("SC_CLK_TCK")


def load_get_job(base: str, job_id: int, duration_s: float) -> tuple[float, list[float]]:
    """``LOAD_CONNECTIONS`` keep-alive connections GET the job for ``duration_s`` seconds.

    The load generator is a bare asyncio HTTP/1.1 client (one thread): httpx spent ~0.6 ms
    of CPU per request, which on a 2-core box was taken from the server being measured.

    Returns:
        ``(requests_per_s, latencies_s)``.
    Raises:
        RuntimeError: a response other than 200.
    """
    url = httpx.URL(base)
    host, port = url.host, int(url.port or 80)
    path = f"{url.path.rstrip('/')}/jobs/{job_id}"
    latencies: list[float] = []

    async def run() -> float:
        t0 = time.perf_counter()
        stop = t0 + duration_s
        await asyncio.gather(
            *(
                _keep_alive_client(host, port, path, stop, latencies)
                for _ in range(LOAD_CONNECTIONS)
            )
        )
        return time.perf_counter() - t0

    elapsed_s = asyncio.run(run())
    return len(latencies) / elapsed_s, latencies


@contextmanager
def serving(url: str, tmp: Path, workers: int) -> Iterator[tuple[str, int]]:
    """Run the API on ``url`` as ``workers`` uvicorn processes (as ``ddpq serve --workers``)
    on a free loopback port until the block ends.

    Yields:
        ``(base_url, pid)``: the API's base URL (…/api/v1) and the uvicorn parent's pid.
    Raises:
        TimeoutError: /readyz did not answer 200 within 90 s.
    """
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
             "--host", "127.0.0.1", "--port", str(port), "--no-access-log",
             "--workers", str(workers)],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
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
        yield f"http://127.0.0.1:{port}/api/v1", api.pid
    finally:
        api.terminate()
        api.wait(30)


def measure_get_job(base: str, pid: int, job_id: int, duration_s: float) -> dict[str, Any]:
    """GET /jobs/{id} load after a 0.5 s warm-up: req/s, p50/p99 (ms), the server's CPU
    per request (µs; all its processes) and the box's 1-minute load average at the end (other
    work on a shared box takes cores from the server and the load generator)."""
    load_get_job(base, job_id, 0.5)  # warm-up
    cpu0 = process_cpu_s(pid)
    rps, lat = load_get_job(base, job_id, duration_s)
    cpu1 = process_cpu_s(pid)
    return {
        "req_per_s": round(rps, 1),
        "p50_ms": round(percentile(lat, 50) * 1000, 2),
        "p99_ms": round(percentile(lat, 99) * 1000, 2),
        "server_cpu_us_per_req": (
            None if cpu0 is None or cpu1 is None else round((cpu1 - cpu0) / len(lat) * 1e6)
        ),
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


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
    # As `ddpq serve --workers N` with one process per core (the goal counts the better run).
    workers = pick(size, 1, os.cpu_count() or 1)
    polls = pick(size, 10, 50, 200)
    tmp = Path(workdir or tempfile.mkdtemp(prefix="ddpq-bench-"))
    res = BenchResult("api", size)
    with pg_schema() as url:
        job_id, points = fill_metrics(url, rows, jobs, Settings().default_owner)
        plan = explain_poll(url, job_id, points - POLL_POINTS)
        with serving(url, tmp, 1) as (base, pid):
            one = measure_get_job(base, pid, job_id, duration_s)
            ml = mlflow_store(tmp, points)
            poll_s: list[float] = []
            ml_s: list[float] = []
            after = points - POLL_POINTS
            with httpx.Client(base_url=base, timeout=30) as http:
                params: dict[str, str | int] = {
                    "name": "loss",
                    "after_step": after,
                    "limit": POLL_POINTS,
                }
                http.get(f"/jobs/{job_id}/metrics", params=params).raise_for_status()  # warm-up
                for _ in range(polls):
                    t0 = time.perf_counter()
                    got = http.get(f"/jobs/{job_id}/metrics", params=params)
                    got.raise_for_status()
                    poll_s.append(time.perf_counter() - t0)
                    assert len(got.json()["points"]) == POLL_POINTS
                    if ml is not None:
                        t0 = time.perf_counter()
                        history = ml[0].get_metric_history(ml[1], "loss")
                        ml_s.append(time.perf_counter() - t0)
                        assert len(history) == points
        per_core: dict[str, Any] | None = None
        if workers > 1:
            with serving(url, tmp, workers) as (base, pid):
                per_core = measure_get_job(base, pid, job_id, duration_s)
    poll_p99 = percentile(poll_s, 99)
    res.figures = {
        "metrics_rows": jobs * points,
        "polled_job_points": points,
        "get_job_req_per_s": one["req_per_s"],
        "get_job_p50_ms": one["p50_ms"],
        "get_job_p99_ms": one["p99_ms"],
        "get_job_server_cpu_us_per_req": one["server_cpu_us_per_req"],
        "get_job_load_avg_1m": one["load_avg_1m"],
        "api_workers": workers,
        "poll_p50_ms": round(median(poll_s) * 1000, 2),
        "poll_p99_ms": round(poll_p99 * 1000, 2),
        "poll_plan": plan,
        "mlflow_history_p50_ms": round(median(ml_s) * 1000, 2) if ml_s else None,
        "mlflow_history_p99_ms": round(percentile(ml_s, 99) * 1000, 2) if ml_s else None,
        "load_connections": LOAD_CONNECTIONS,
        "duration_s": duration_s,
    }
    speedup = ratio(median(ml_s), median(poll_s)) if ml_s else None
    res.ratios = {
        "get_job_vs_goal": ratio(one["req_per_s"], GOAL_REQ_PER_S),
        "mlflow_vs_ddpq_poll_p50": speedup,
    }
    res.goals = {
        # Both said plainly: one process, and one per core (`ddpq serve --workers N`).
        "get_job>=1500/s_one_process": one["req_per_s"] >= GOAL_REQ_PER_S,
        "poll_p99<=20ms": poll_p99 <= GOAL_POLL_P99_S,
        ">=10x_faster_than_mlflow": None if speedup is None else speedup >= GOAL_VS_MLFLOW,
    }
    if per_core is not None:  # only when more than one process was measured
        res.figures[f"get_job_{workers}_workers"] = per_core
        res.ratios[f"get_job_{workers}_workers_vs_goal"] = ratio(
            per_core["req_per_s"], GOAL_REQ_PER_S
        )
        res.goals[f"get_job>=1500/s_{workers}_workers"] = per_core["req_per_s"] >= GOAL_REQ_PER_S
    if rows < 10_000_000:
        res.notes.append(f"metrics table of {jobs * points:,} rows, not 10M (use --size full)")
    res.notes.append(
        "one uvicorn process (default CLI flags) on PostgreSQL, then one per core "
        "(get_job_N_workers, `ddpq serve --workers N`); load generator = 8 keep-alive "
        "connections of a bare asyncio HTTP/1.1 client in the bench process; "
        "server_cpu_us_per_req = the uvicorn process's CPU time ÷ requests (1e6 ÷ it = the "
        "req/s one core could serve); MLflow = get_metric_history on a local SQLite store "
        "(it has no after_step: the whole run history is read)"
    )
    return res


def main() -> None:
    """CLI: ``python -m bench.api --size tiny``."""
    cli_main(run, __doc__ or "")


if __name__ == "__main__":
    main()
