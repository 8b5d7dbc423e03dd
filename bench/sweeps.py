"""Benchmark: submitting a 1,000-trial sweep end to end (one POST /sweeps: expansion,
validation of every trial, one transaction with bulk inserts) beside 1,000 single
POST /jobs calls, on SQLite and PostgreSQL, through a real uvicorn server."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, select

from bench.api import serving
from bench.common import BenchResult, cli_main, migrated, pg_schema, pick, ratio, sqlite_url
from service.store.models import Job, SweepTrial

GOAL_SWEEP_S = 2.0
BASE: dict[str, Any] = {
    "name": "bench",
    "task": "regression",
    "resources": {"nproc_per_node": 2},
    "training": {"max_steps": 100},
}


def sweep_body(trials: int) -> dict[str, Any]:
    """A sweep of ``trials`` trials: a grid of learning rates × a grid of widths."""
    widths = [16, 32, 64, 128]
    per = max(1, trials // len(widths))
    return {
        "name": "bench-sweep",
        "base": BASE,
        "axes": {
            "training.lr": {"grid": [round(1e-4 * (1 + i), 6) for i in range(per)]},
            "config.hidden": {"grid": widths},
        },
        "max_concurrent": 8,
    }


def measure(url: str, tmp: Path, trials: int) -> dict[str, Any]:
    """Seconds for one POST /sweeps of ``trials`` trials and for ``trials`` POST /jobs in a row
    (one keep-alive connection), plus what got stored."""
    db = migrated(url)
    with (
        serving(url, tmp, workers=1) as (base, _pid),
        httpx.Client(base_url=base, timeout=120) as http,
    ):
        http.post("/jobs", json=BASE).raise_for_status()  # warm-up: the first request's imports
        t0 = time.perf_counter()
        r = http.post("/sweeps", json=sweep_body(trials))
        sweep_s = time.perf_counter() - t0
        r.raise_for_status()
        t0 = time.perf_counter()
        for i in range(trials):
            http.post("/jobs", json={**BASE, "name": f"single-{i}"}).raise_for_status()
        singles_s = time.perf_counter() - t0
    with db.session(write=False) as s:
        stored = s.scalar(select(func.count()).where(Job.sweep_id.is_not(None))) or 0
        rows = s.scalar(select(func.count()).select_from(SweepTrial)) or 0
    db.dispose()
    return {
        "sweep_s": round(sweep_s, 3),
        "single_posts_s": round(singles_s, 3),
        "trials": r.json()["trials_total"],
        "trial_jobs_stored": stored,
        "trial_rows_stored": rows,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def run(size: str, *, workdir: Path | None = None) -> BenchResult:
    """POST /sweeps of 1,000 trials (tiny: 40) vs as many POST /jobs, SQLite and PostgreSQL."""
    trials = pick(size, 40, 1000)
    tmp = Path(workdir or tempfile.mkdtemp(prefix="ddpq-bench-"))
    res = BenchResult("sweeps", size)
    (tmp / "sqlite").mkdir(exist_ok=True)
    res.figures["sqlite"] = measure(sqlite_url(tmp / "sqlite"), tmp, trials)
    with pg_schema() as url:
        res.figures["postgresql"] = measure(url, tmp, trials)
    for dialect in ("sqlite", "postgresql"):
        fig = res.figures[dialect]
        res.ratios[f"{dialect}_sweep_vs_single_posts"] = ratio(
            fig["sweep_s"], fig["single_posts_s"]
        )
        res.ratios[f"{dialect}_sweep_vs_goal"] = ratio(fig["sweep_s"], GOAL_SWEEP_S)
        res.goals[f"{dialect}_sweep<={GOAL_SWEEP_S:.0f}s"] = fig["sweep_s"] <= GOAL_SWEEP_S
        res.goals[f"{dialect}_all_trials_stored"] = (
            fig["trial_jobs_stored"] == fig["trial_rows_stored"] == fig["trials"] == trials
        )
    res.notes.append(
        "sweep_s: one POST /sweeps end to end (client clock); single_posts_s: as many "
        "POST /jobs one after another on one keep-alive connection; one uvicorn worker"
    )
    return res


def main() -> None:
    """CLI: ``python -m bench.sweeps --size tiny``."""
    cli_main(run, __doc__ or "")


if __name__ == "__main__":
    main()
