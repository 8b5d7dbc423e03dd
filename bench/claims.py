"""Benchmark #4: claims/s of ``claim_next_job`` with concurrent claimers; duplicates counted."""

from __future__ import annotations

import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from sqlalchemy import func, select

from bench.common import (
    BenchResult,
    add_worker,
    cli_main,
    migrated,
    pg_schema,
    pick,
    queue_jobs,
    ratio,
    sqlite_url,
)
from service.store.db import Database
from service.store.jobs.claims import claim_next_job
from service.store.models import Job

GOAL_CLAIMS_PER_S = {"postgresql": 500.0, "sqlite": 200.0}
CLAIMERS = 8


def measure_claims(
    db: Database, jobs: int, claimers: int, target: int | None = None
) -> dict[str, float | int]:
    """Queue ``jobs`` jobs, let ``claimers`` threads claim until the queue is empty or
    ``target`` claims were made (the rate at a queue ``jobs`` deep, in less time).

    Returns:
        ``claims``, ``claims_per_s``, ``duplicates`` (ids claimed more than once),
        ``starting_rows`` (rows the database holds as starting) and ``errors``.
    """
    queue_jobs(db, jobs)
    workers = [add_worker(db, f"claimer-{i}") for i in range(claimers)]
    claimed: list[list[int]] = [[] for _ in range(claimers)]
    errors: list[str] = []
    go = threading.Barrier(claimers + 1)
    goal = target or jobs
    made = [0]
    lock = threading.Lock()

    def claim_loop(i: int) -> None:
        go.wait()
        while True:
            try:
                with db.session() as session:
                    job = claim_next_job(
                        session, worker_id=workers[i], launcher="local",
                        max_gpus_per_node=0, lease_s=3600,
                    )  # fmt: skip
                    job_id = job.id if job is not None else None
            except Exception as exc:  # counted and reported, the loop goes on
                errors.append(repr(exc))
                if len(errors) > 100:
                    return
                continue
            if job_id is None:
                return
            claimed[i].append(job_id)
            with lock:
                made[0] += 1
                if made[0] >= goal:
                    return

    threads = [threading.Thread(target=claim_loop, args=(i,)) for i in range(claimers)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed_s = time.perf_counter() - t0
    counts = Counter(j for ids in claimed for j in ids)
    with db.session(write=False) as session:
        starting = session.scalar(
            select(func.count()).select_from(Job).where(Job.state == "starting")
        )
    total = sum(counts.values())
    return {
        "claims": total,
        "claims_per_s": round(total / elapsed_s, 1),
        "duplicates": sum(c - 1 for c in counts.values() if c > 1),
        "starting_rows": int(starting or 0),
        "errors": len(errors),
    }


def run(size: str, *, workdir: Path | None = None) -> BenchResult:
    """Claims/s on SQLite and PostgreSQL (a throwaway schema), 8 claimer threads."""
    jobs = pick(size, 200, 10_000)
    # default: the first 1,000 claims of 10,000; full: all 10,000 (None here would fall back)
    target = pick(size, None, 1_000, 10_000)
    tmp = Path(workdir or tempfile.mkdtemp(prefix="ddpq-bench-"))
    res = BenchResult("claims", size)
    figures: dict[str, dict[str, float | int]] = {}
    sqlite_db = migrated(sqlite_url(tmp))
    figures["sqlite"] = measure_claims(sqlite_db, jobs, CLAIMERS, target)
    sqlite_db.dispose()
    with pg_schema() as url:
        pg_db = Database.from_url(url, pool_size=CLAIMERS + 2)
        from service.store import migrate

        migrate.upgrade(pg_db.engine)
        figures["postgresql"] = measure_claims(pg_db, jobs, CLAIMERS, target)
        pg_db.dispose()
    res.figures = {"jobs": jobs, "claims_measured": target or jobs, "claimers": CLAIMERS, **figures}
    for dialect, fig in figures.items():
        goal = GOAL_CLAIMS_PER_S[dialect]
        res.ratios[f"{dialect}_vs_goal"] = ratio(float(fig["claims_per_s"]), goal)
        res.goals[f"{dialect}>={goal:.0f}/s"] = float(fig["claims_per_s"]) >= goal
        res.goals[f"{dialect}_zero_duplicates"] = fig["duplicates"] == 0 and fig[
            "starting_rows"
        ] == fig["claims"] >= (target or jobs)
    res.notes.append("no anchor in the issue: ratio is claims/s ÷ the goal; threads, one process")
    return res


def main() -> None:
    """CLI: ``python -m bench.claims --size tiny``."""
    cli_main(run, __doc__ or "")


if __name__ == "__main__":
    main()
