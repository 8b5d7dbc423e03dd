"""Benchmark: the sweep page at 10,000 trials — its first load (goal ≤ 1 s) and each poll
(goal ≤ 50 KB), against the page's old calls measured in the same run.

The page (``service/web/static/sweep.js``) now loads: the sweep, the best 500 trials by the
objective (colours, best curves, scatters), one page of 50 trials, the metric names, and the
best 10 trials' curves (``job_id=…``, 300 points each). Each 2 s poll reads: the sweep, the
trials whose job changed since the previous answer (``changed_since``), the page again (the
table sorted by the objective) when a changed trial sorts into it, and, every 5th poll, up
to 2 changed curves (counted in every poll here: the worst case). Between two polls
``running`` trials each report a point (their job rows change), as a live sweep's do.

The anchor is the page's old load and poll on the same data and server: the sweep, the whole
trials table, the names and every trial's curve (20,000 ÷ trials points, at least 50); each
poll the sweep and the whole table. One ``ddpq serve`` on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import bindparam, text

from bench.common import (
    BenchResult,
    cli_main,
    median,
    migrated,
    pg_schema,
    pick,
    serve_api,
    sqlite_url,
)
from service.store.db import Database
from service.store.metrics.points import MetricPoint, record_metrics

GOAL_FIRST_LOAD_S = 1.0
GOAL_POLL_BYTES = 50_000
POLL_S = 2.0
PAGE = 50  # sweep_trials.js PAGE_SIZE
TOP = 500  # sweep.js TOP_LIMIT
BEST = 10  # sweep.js BEST_CURVES
CURVE_POINTS = 300  # sweep.js PICKED_POINTS
REFRESHED = 2  # sweep.js REFRESH_AT_ONCE
# Finished trials' times (the text both databases' columns read).
T0, T1 = "2026-01-01 00:00:00.000000", "2026-01-01 01:00:00.000000"


def submit_sweep(base: str, trials: int) -> int:
    """POST a sweep of ``trials`` trials (a grid over lr × hidden); returns its id."""
    side = max(1, int(trials**0.5))
    body = {
        "name": "bench-trials",
        "base": {"name": "t", "task": "regression", "training": {"max_steps": 10}},
        "axes": {
            "training.lr": {"grid": [round(1e-5 * (i + 1), 7) for i in range(side)]},
            "config.hidden": {"grid": list(range(1, trials // side + 1))},
        },
        "objective": {"metric": "loss", "mode": "min", "at": "last"},
    }
    res = httpx.post(f"{base}/api/v1/sweeps", json=body, timeout=600)
    res.raise_for_status()
    return int(res.json()["id"])


def fill(db_url: str, sweep_id: int, points: int, running: int) -> list[int]:
    """Every trial's job finished with ``points`` loss points and a last loss that differs
    per trial, except the first ``running`` ones (running); returns the running jobs' ids."""
    db = migrated(db_url)
    postgres = db.engine.dialect.name == "postgresql"
    value = "((j.id * 7919) % 10007) / 10007.0"
    own = value.replace("j.id", "jobs.id")  # in the UPDATE of jobs itself
    if postgres:
        latest = f"json_build_object('loss', json_build_object('step', :n, 'value', {own}))"
        insert = (
            "INSERT INTO metrics (job_id, name, step, attempt, epoch, value, time) "
            f"SELECT j.id, 'loss', s, 1, 0, 1.0 / s + {value}, now() "
            "FROM jobs j, generate_series(1, :n) AS s WHERE j.sweep_id = :sweep"
        )
    else:
        latest = f"json_object('loss', json_object('step', :n, 'value', {own}))"
        insert = (
            "WITH RECURSIVE s(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM s WHERE x < :n) "
            "INSERT INTO metrics (job_id, name, step, attempt, epoch, value, time) "
            f"SELECT j.id, 'loss', s.x, 1, 0, 1.0 / s.x + {value}, "
            "'2026-01-01 00:00:00.000000' FROM jobs j, s WHERE j.sweep_id = :sweep"
        )
    with db.session() as session:
        session.execute(
            text(
                f"UPDATE jobs SET state = 'succeeded', attempt = 1, latest_metrics = {latest}, "
                "started_at = :t0, finished_at = :t1, updated_at = :t1 WHERE sweep_id = :sweep"
            ),
            {"n": points, "sweep": sweep_id, "t0": T0, "t1": T1},
        )
        ids = list(
            session.execute(
                text("SELECT id FROM jobs WHERE sweep_id = :sweep ORDER BY id LIMIT :k"),
                {"sweep": sweep_id, "k": running},
            ).scalars()
        )
        session.execute(
            text(
                "UPDATE jobs SET state = 'running', finished_at = NULL WHERE id IN :ids"
            ).bindparams(bindparam("ids", expanding=True)),
            {"ids": ids},
        )
        session.execute(text(insert), {"n": points, "sweep": sweep_id})
    with db.engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(
            text("VACUUM ANALYZE" if postgres else "ANALYZE")
        )
    db.dispose()
    return ids


def step_running(db: Database, job_ids: list[int], step: int) -> None:
    """Each running job reports one point at ``step`` (its job row changes), as a live one."""
    for job_id in job_ids:
        point = MetricPoint(name="loss", step=step, value=1.0 / step + job_id * 1e-6)
        with db.session() as session:
            record_metrics(session, job_id, 1, [point], progress={"step": step})


def get(http: httpx.Client, path: str, params: Any = None) -> tuple[float, int, Any]:
    """GET ``path``: (seconds, body bytes on the wire, JSON). httpx asks for gzip as a
    browser does, so the bytes are what the page downloads (the API gzips JSON answers)."""
    t0 = time.perf_counter()
    res = http.get(path, params=params)
    res.raise_for_status()
    return time.perf_counter() - t0, res.num_bytes_downloaded, res.json()


def new_first_load(http: httpx.Client, sweep_id: int) -> dict[str, Any]:
    """The page's first load now: seconds, bytes, and the delta token and best jobs."""
    t0 = time.perf_counter()
    sizes = 0
    _, n, _ = get(http, f"/sweeps/{sweep_id}")
    sizes += n
    best_params = {"sort": "objective_value", "order": "asc", "limit": TOP}
    _, n, top = get(http, f"/sweeps/{sweep_id}/trials", best_params)
    sizes += n
    _, n, _ = get(http, f"/sweeps/{sweep_id}/trials", {"limit": PAGE, "offset": 0})
    sizes += n
    _, n, _ = get(http, f"/sweeps/{sweep_id}/metrics/names")
    sizes += n
    best = [t["job_id"] for t in top["trials"] if t["objective_value"] is not None][:BEST]
    curve_params: Any = {"name": "loss", "max_points": CURVE_POINTS, "job_id": best}
    _, n, _ = get(http, f"/sweeps/{sweep_id}/metrics", curve_params)
    sizes += n
    return {"s": time.perf_counter() - t0, "bytes": sizes, "since": top["changed_since"]}


def new_poll(
    http: httpx.Client, sweep_id: int, since: str, curves: list[int], held: dict[str, Any]
) -> dict[str, Any]:
    """One poll now, the table's first page sorted by the objective (ascending) and a curve
    refresh included. ``held["page"]``: the page's rows as ``sweep_trials.js`` holds them.
    As the page does, a changed trial that may sort at or before the page's last row (or
    was on it) re-sorts the page from the rows held when that is exact (``merged_page``),
    and only else reads the page again."""
    t0 = time.perf_counter()
    sizes = 0
    _, n, _ = get(http, f"/sweeps/{sweep_id}")
    sizes += n
    _, n, delta = get(http, f"/sweeps/{sweep_id}/trials", {"changed_since": since})
    sizes += n
    changed = delta["trials"]
    page = held["page"]
    last = page[-1]["objective_value"] if page else None
    on_page = {t["key"] for t in page}
    moves = any(
        t["key"] in on_page or (last is not None and t["objective_value"] is not None
                                and t["objective_value"] <= last)
        for t in changed
    )  # fmt: skip
    merged = merged_page(page, changed) if moves else page
    reload = merged is None
    if merged is None:
        sizes += read_page(http, sweep_id, held)
    else:
        held["page"] = merged
    curve_params: Any = {"name": "loss", "max_points": CURVE_POINTS, "job_id": curves}
    _, n, _ = get(http, f"/sweeps/{sweep_id}/metrics", curve_params)
    sizes += n
    return {
        "s": time.perf_counter() - t0,
        "bytes": sizes,
        "since": delta["changed_since"],
        "changed": len(changed),
        "page_reads": int(reload),
    }


def _order(t: dict[str, Any]) -> tuple[float, int]:
    return (t["objective_value"], t["position"])


def merged_page(page: list[dict[str, Any]], changed: list[dict[str, Any]]) -> list[Any] | None:
    """``sweep_trials.js``'s ``mergedFirstPage`` for the objective ascending: the full first
    page re-sorted from its rows and the changed trials that may sort into it, or None when
    only the server can tell (a row got worse past the old last row, a missing value)."""
    if len(page) < PAGE or page[-1]["objective_value"] is None:
        return None
    last = _order(page[-1])
    rows = {t["key"]: t for t in page}
    for t in changed:
        v = t["objective_value"]
        if t["key"] in rows or (v is not None and v <= last[0]):
            rows[t["key"]] = t
    if any(t["objective_value"] is None for t in rows.values()):
        return None
    merged = sorted(rows.values(), key=_order)[:PAGE]
    return merged if _order(merged[-1]) <= last else None


def read_page(http: httpx.Client, sweep_id: int, held: dict[str, Any]) -> int:
    """Read the first page sorted by the objective into ``held["page"]``; its bytes."""
    params = {"sort": "objective_value", "order": "asc", "limit": PAGE}
    _, n, page = get(http, f"/sweeps/{sweep_id}/trials", params)
    held["page"] = page["trials"]
    return n


def old_first_load(http: httpx.Client, sweep_id: int, trials: int) -> dict[str, Any]:
    """The page's first load before: the whole table and every trial's curve."""
    t0 = time.perf_counter()
    sizes = 0
    for path, params in (
        (f"/sweeps/{sweep_id}", None),
        (f"/sweeps/{sweep_id}/trials", None),
        (f"/sweeps/{sweep_id}/metrics/names", None),
        (f"/sweeps/{sweep_id}/metrics", {"name": "loss", "max_points": max(50, 20_000 // trials)}),
    ):
        _, n, _ = get(http, path, params)
        sizes += n
    return {"s": time.perf_counter() - t0, "bytes": sizes}


def old_poll(http: httpx.Client, sweep_id: int) -> dict[str, Any]:
    """One poll before: the sweep and the whole table."""
    t0 = time.perf_counter()
    _, a, _ = get(http, f"/sweeps/{sweep_id}")
    _, b, _ = get(http, f"/sweeps/{sweep_id}/trials")
    return {"s": time.perf_counter() - t0, "bytes": a + b}


def measure(
    db_url: str,
    workdir: Path,
    trials: int,
    points: int,
    running: int,
    polls: int,
    poll_s: float = POLL_S,
) -> dict[str, Any]:
    """Serve ``db_url``, build the sweep, then time the old and the new page side by side."""
    migrated(db_url).dispose()
    with serve_api(db_url, workdir) as base:
        sweep_id = submit_sweep(base, trials)
        live = fill(db_url, sweep_id, points, running)
        db = Database.from_url(db_url)
        fig: dict[str, Any] = {}
        with httpx.Client(base_url=f"{base}/api/v1", timeout=600) as http:
            new_first_load(http, sweep_id)  # warm-up: caches, plans, the pool
            old_first_load(http, sweep_id, trials)
            new_loads = [new_first_load(http, sweep_id) for _ in range(3)]
            old_loads = [old_first_load(http, sweep_id, trials) for _ in range(3)]
            since = new_loads[-1]["since"]
            held: dict[str, Any] = {}
            read_page(http, sweep_id, held)  # the table as the page shows it
            new_polls, old_polls = [], []
            for i in range(polls):
                t0 = time.perf_counter()
                step_running(db, live, points + 1 + i)
                new = new_poll(http, sweep_id, since, live[:REFRESHED], held)
                since = new["since"]
                new_polls.append(new)
                old_polls.append(old_poll(http, sweep_id))
                time.sleep(max(0.0, poll_s - (time.perf_counter() - t0)))
        db.dispose()
    fig["first_load_s"] = round(median([x["s"] for x in new_loads]), 3)
    fig["first_load_bytes"] = new_loads[-1]["bytes"]
    fig["old_first_load_s"] = round(median([x["s"] for x in old_loads]), 3)
    fig["old_first_load_bytes"] = old_loads[-1]["bytes"]
    fig["poll_bytes_max"] = max(x["bytes"] for x in new_polls)
    fig["poll_bytes_p50"] = int(median([x["bytes"] for x in new_polls]))
    fig["poll_s_p50"] = round(median([x["s"] for x in new_polls]), 3)
    fig["poll_changed_trials_max"] = max(x["changed"] for x in new_polls)
    fig["poll_page_reads"] = sum(x["page_reads"] for x in new_polls)
    fig["old_poll_bytes"] = old_polls[-1]["bytes"]
    fig["old_poll_s_p50"] = round(median([x["s"] for x in old_polls]), 3)
    return fig


def run(size: str, *, workdir: Path | None = None) -> BenchResult:
    """The sweep page at many trials on PostgreSQL and SQLite, new calls vs old."""
    trials = pick(size, 200, 10_000)
    points = pick(size, 10, 100, 1_000)
    running = pick(size, 10, 100)
    polls = pick(size, 2, 10)
    poll_s = pick(size, 0.5, POLL_S)
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="ddpq-bench-") as scratch:
            return run(size, workdir=Path(scratch))
    res = BenchResult("sweep_trials", size)
    with pg_schema() as url:
        (workdir / "pg").mkdir(exist_ok=True)
        res.figures["postgresql"] = measure(
            url, workdir / "pg", trials, points, running, polls, poll_s
        )
    (workdir / "sqlite").mkdir(exist_ok=True)
    res.figures["sqlite"] = measure(
        sqlite_url(workdir), workdir / "sqlite", trials, points, running, polls, poll_s
    )
    res.figures.update(trials=trials, points_per_trial=points, running_trials=running)
    for db in ("postgresql", "sqlite"):
        f = res.figures[db]
        res.ratios[f"{db}_first_load_vs_old"] = round(f["first_load_s"] / f["old_first_load_s"], 4)
        res.ratios[f"{db}_poll_bytes_vs_old"] = round(f["poll_bytes_max"] / f["old_poll_bytes"], 4)
        res.ratios[f"{db}_first_load_vs_goal"] = round(f["first_load_s"] / GOAL_FIRST_LOAD_S, 4)
        res.goals[f"{db}_first_load<=1s"] = f["first_load_s"] <= GOAL_FIRST_LOAD_S
        res.goals[f"{db}_poll<=50KB"] = f["poll_bytes_max"] <= GOAL_POLL_BYTES
    res.notes.append(
        "one `ddpq serve`; calls in the page's order over one keep-alive httpx connection; "
        "bytes as downloaded (gzip, as a browser asks; since 2026-12-05, JSON before); "
        "first loads: median of 3 after one warm-up each; polls every 2 s with the running "
        "trials reporting a point between two; poll bytes include a 2-curve refresh and, when a "
        "changed trial sorts into it, the first page sorted by the objective; old_*: the "
        "page's calls before (whole table, every trial's curve) on the same server and data"
    )
    res.notes.append(json.dumps({"page_rows": PAGE, "best_read": TOP, "best_curves": BEST}))
    return res


if __name__ == "__main__":
    cli_main(run, __doc__ or "")
