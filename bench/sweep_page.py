"""Benchmark: the API calls a sweep's page makes on load, 100 trials × 10k points each (≤ 1 s).

The page (``service/web/static/sweep.js``) asks, one after the other: the sweep, its trials,
the metric names, then the chosen metric's curves of every trial downsampled per trial
(``max_points`` = 20,000 ÷ trials, 200 for 100 trials). This times that sequence over HTTP
against ``ddpq serve`` on PostgreSQL and on SQLite, each call and the whole page, after one
warm-up load. ``--size full`` gives each trial 100k points (10M rows).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text

from bench.common import (
    BenchResult,
    cli_main,
    median,
    migrated,
    percentile,
    pg_schema,
    pick,
    serve_api,
    sqlite_url,
)

GOAL_PAGE_S = 1.0
POINT_BUDGET = 20_000  # the page's points of all curves together (sweep.js POINT_BUDGET)
LATEST = json.dumps({"loss": {"step": 1, "value": 0.5}, "eval_loss": {"step": 1, "value": 0.6}})


def submit_sweep(base: str, trials: int) -> int:
    """POST a sweep of ``trials`` trials (a grid over the learning rate); returns its id."""
    body = {
        "name": "bench-page",
        "base": {"name": "t", "task": "regression", "training": {"max_steps": 10}},
        "axes": {"training.lr": {"grid": [round(1e-4 * (i + 1), 6) for i in range(trials)]}},
        "objective": {"metric": "loss", "mode": "min", "at": "last"},
    }
    res = httpx.post(f"{base}/api/v1/sweeps", json=body, timeout=120)
    res.raise_for_status()
    return int(res.json()["id"])


def fill(db_url: str, sweep_id: int, points: int) -> int:
    """Every trial's job running with ``points`` loss points (steps 1…points, a noisy
    decreasing curve), written server-side; then VACUUM ANALYZE as autovacuum would after a
    long ingest. Returns the rows written."""
    db = migrated(db_url)
    postgres = db.engine.dialect.name == "postgresql"
    if postgres:
        insert = (
            "INSERT INTO metrics (job_id, name, step, attempt, epoch, value, time) "
            "SELECT j.id, 'loss', s, 1, 0, 1.0 / s + random() * 0.05, now() "
            "FROM jobs j, generate_series(1, :n) AS s WHERE j.sweep_id = :sweep"
        )
    else:
        insert = (
            "WITH RECURSIVE s(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM s WHERE x < :n) "
            "INSERT INTO metrics (job_id, name, step, attempt, epoch, value, time) "
            "SELECT j.id, 'loss', s.x, 1, 0, 1.0 / s.x + abs(random()) / 1.8e20, "
            "'2026-01-01 00:00:00.000000' FROM jobs j, s WHERE j.sweep_id = :sweep"
        )
    with db.session() as session:
        session.execute(
            text("UPDATE jobs SET state = 'running', latest_metrics = :latest WHERE sweep_id = :s"),
            {"latest": LATEST, "s": sweep_id},
        )
        session.execute(text(insert), {"n": points, "sweep": sweep_id})
        rows = session.execute(
            text("SELECT count(*) FROM metrics m JOIN jobs j ON j.id = m.job_id "
                 "WHERE j.sweep_id = :sweep"), {"sweep": sweep_id},
        ).scalar_one()  # fmt: skip
    with db.engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(
            text("VACUUM ANALYZE metrics" if postgres else "ANALYZE")
        )
    db.dispose()
    return int(rows)


def load_page(http: httpx.Client, sweep_id: int, trials: int) -> dict[str, Any]:
    """The page's first load: its four calls in its order. Returns seconds per call, the
    total, and what the curves call sent back."""
    per_trial = max(50, min(1000, POINT_BUDGET // max(1, trials)))
    calls: dict[str, tuple[str, dict[str, str | int] | None]] = {
        "sweep": (f"/sweeps/{sweep_id}", None),
        "trials": (f"/sweeps/{sweep_id}/trials", None),
        "names": (f"/sweeps/{sweep_id}/metrics/names", None),
        "curves": (f"/sweeps/{sweep_id}/metrics", {"name": "loss", "max_points": per_trial}),
    }
    out: dict[str, Any] = {}
    t_page = time.perf_counter()
    for name, (path, params) in calls.items():
        t0 = time.perf_counter()
        res = http.get(path, params=params)
        res.raise_for_status()
        out[name] = time.perf_counter() - t0
        if name == "curves":
            series = res.json()["series"]
            out["curve_bytes"] = len(res.content)
            out["curve_points"] = sum(len(s["points"]) for s in series)
            out["curve_trials"] = len(series)
            out["curve_sampled_trials"] = sum(1 for s in series if s["sampled"])
    out["page"] = time.perf_counter() - t_page
    return out


def measure(db_url: str, workdir: Path, trials: int, points: int, loads: int) -> dict[str, Any]:
    """Serve ``db_url``, build the sweep, and time ``loads`` page loads after a warm-up."""
    migrated(db_url).dispose()
    with serve_api(db_url, workdir) as base:
        sweep_id = submit_sweep(base, trials)
        rows = fill(db_url, sweep_id, points)
        with httpx.Client(base_url=f"{base}/api/v1", timeout=120) as http:
            first = load_page(http, sweep_id, trials)  # warm-up: caches, plans, the pool
            runs = [load_page(http, sweep_id, trials) for _ in range(loads)]
    figures: dict[str, Any] = {"metrics_rows": rows, "first_load_s": round(first["page"], 3)}
    for key in ("sweep", "trials", "names", "curves", "page"):
        values = [r[key] for r in runs]
        figures[f"{key}_p50_ms"] = round(median(values) * 1000, 1)
        figures[f"{key}_p90_ms"] = round(percentile(values, 90) * 1000, 1)
    for key in ("curve_bytes", "curve_points", "curve_trials", "curve_sampled_trials"):
        figures[key] = runs[-1][key]
    return figures


def run(size: str, *, workdir: Path | None = None) -> BenchResult:
    """The sweep page's load on PostgreSQL and SQLite."""
    trials = pick(size, 10, 100)
    points = pick(size, 1_000, 10_000, 100_000)
    loads = pick(size, 3, 10)
    if workdir is None:  # a full run leaves a 750 MB SQLite file: not kept
        with tempfile.TemporaryDirectory(prefix="ddpq-bench-") as scratch:
            return run(size, workdir=Path(scratch))
    tmp = workdir
    res = BenchResult("sweep_page", size)
    with pg_schema() as url:
        (tmp / "pg").mkdir(exist_ok=True)
        res.figures["postgresql"] = measure(url, tmp / "pg", trials, points, loads)
    (tmp / "sqlite").mkdir(exist_ok=True)
    res.figures["sqlite"] = measure(sqlite_url(tmp), tmp / "sqlite", trials, points, loads)
    res.figures["trials"] = trials
    res.figures["points_per_trial"] = points
    for db in ("postgresql", "sqlite"):
        page_s = res.figures[db]["page_p50_ms"] / 1000
        res.ratios[f"{db}_page_p50_vs_goal"] = round(page_s / GOAL_PAGE_S, 4)
        res.goals[f"{db}_page<=1s"] = page_s <= GOAL_PAGE_S
    res.notes.append(
        "one `ddpq serve` process; the page's four calls in sequence over one keep-alive "
        "httpx connection (sweep, trials, metric names, curves at 20,000 ÷ trials points per "
        "trial); p50/p90 over the loads after one warm-up load; curve_sampled_trials: trials "
        "whose history was past the read budget (service.store.sweeps.metrics."
        "MAX_SCANNED_POINTS), so sampled per bucket instead of min/max"
    )
    return res


if __name__ == "__main__":
    cli_main(run, __doc__ or "")
