"""Benchmark #11: the worker API (``/api/v1/workers/self/…``) under a real ``ddpq serve``.

1. Submit → claim latency of one idle worker (``ApiRecords`` over HTTP): the long poll
   (``claim(0, wait_s=1)`` in a loop, as ``worker.loop``'s ``_pause``) against the previous
   design's claim poll (``CLAIM_POLL_S`` = 0.2 s), interleaved, on SQLite and PostgreSQL.
2. A fleet of simulated workers of ``FLEET_SLOTS`` slots each, long-polling ``ddpq serve
   --workers 2`` over PostgreSQL (``bench.worker_fleet``), each claiming up to its free slots
   per request as ``worker.loop`` does: claims/s, duplicate claims, the API's database
   connections against its pools, and the API's CPU seconds per 1,000 claims. The goal
   (≥ 500 claims/s) is judged on the 200 workers claiming only; with each job's lifecycle
   (two transition requests per job besides its share of a claim) the rate is the API's
   jobs/s, reported beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench import common
from bench.common import BenchResult, cli_main, median, percentile, pick, ratio
from bench.worker_fleet import (
    ConnectionSampler,
    Phase,
    duplicates,
    idle_fleet,
    job_states,
    run_phase,
)
from service.core.holds import ClaimedJob, Transition
from service.core.states import JobState
from service.store.auth.service import create_worker_token
from service.store.db import PG_POOL_SIZE
from worker.api_client import ApiRecords
from worker.loop import MAX_CLAIM_WAIT_S

ANCHOR_POLL_S = 0.2  # the previous worker loop's CLAIM_POLL_S
MODES = ("long_poll", "poll_0.2s")
# label → (database, API processes); the last shows a submission reaching the other process.
SERVERS = {"sqlite": ("sqlite", 1), "postgresql": ("postgresql", 1), "pg_2procs": ("postgresql", 2)}
CLAIM_TIMEOUT_S = 15.0  # a submitted job not claimed by then: the run fails (a bug)
GOAL_P50_S = 0.100
GOAL_CLAIMS_PER_S = 500.0
API_WORKERS = 2
# Each API process's engine: pool_size + max_overflow, both PG_POOL_SIZE (service.store.db).
POOL_CONNECTIONS = API_WORKERS * 2 * PG_POOL_SIZE
WARM_UP_JOBS = 40
FLEET_TOKENS = 4  # the simulated workers' ids are spread over this many worker tokens
FLEET_LEASE_S = "600"  # no lease of a claimed-only job lapses (and is requeued) mid-run
# Slots of each simulated worker: a worker with free slots claims up to that many jobs per
# request (worker.loop), so a fleet of one-slot workers would be one request per job.
FLEET_SLOTS = 4
# (name, simulated workers, each job run starting → running → succeeded at once)
PHASES = (
    ("w200_lifecycle", 200, True),
    ("w50_lifecycle", 50, True),
    ("w200_claim_only", 200, False),
)
TINY_PHASES = (
    ("w40_lifecycle", 40, True),
    ("w10_lifecycle", 10, True),
    ("w40_claim_only", 40, False),
)


# -- 1. submit → claim latency -----------------------------------------------------------------


def submit_to_claim_s(
    records: ApiRecords, http: httpx.Client, mode: str, rng: random.Random
) -> float:
    """One idle worker waits in ``mode``; a job is submitted at a random moment of its wait.

    Returns:
        Seconds from the submit request's start to the worker's claim answer.
    Raises:
        RuntimeError: the job was not claimed within CLAIM_TIMEOUT_S, or another job was.
    """
    got: list[tuple[float, ClaimedJob]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def wait_for_job() -> None:
        try:
            while not stop.is_set():
                if mode == "long_poll":
                    job = records.claim(0, wait_s=MAX_CLAIM_WAIT_S)
                else:  # the anchor: a claim that does not wait, every ANCHOR_POLL_S
                    if stop.wait(ANCHOR_POLL_S):
                        return
                    job = records.claim(0, wait_s=0.0)
                if job is not None:
                    got.append((time.perf_counter(), job))
                    return
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    thread = threading.Thread(target=wait_for_job, daemon=True)
    thread.start()
    # A random phase of both modes' periods (a poll every 0.2 s, a long poll every 1 s).
    time.sleep(rng.uniform(0.25, 0.25 + MAX_CLAIM_WAIT_S))
    t0 = time.perf_counter()
    resp = http.post("/api/v1/jobs", json=common.TINY_SPEC)
    resp.raise_for_status()
    job_id = int(resp.json()["id"])
    thread.join(CLAIM_TIMEOUT_S)
    stop.set()
    if errors:
        raise RuntimeError(f"{mode}: the claim failed: {errors[0]!r}")
    if not got:
        raise RuntimeError(f"{mode}: job {job_id} not claimed within {CLAIM_TIMEOUT_S} s")
    t1, job = got[0]
    if job.job_id != job_id:
        raise RuntimeError(f"{mode}: claimed job {job.job_id}, submitted {job_id}")
    # Nothing left held: the job ends, so the next repetition's queue is empty again.
    records.apply(Transition(job_id, JobState.STARTING, JobState.RUNNING, "bench"))
    records.apply(Transition(job_id, JobState.RUNNING, JobState.SUCCEEDED, "bench"))
    return t1 - t0


def measure_latency(api_url: str, token: str, reps: int, seed: int) -> dict[str, list[float]]:
    """``reps`` submissions per mode, interleaved (ABAB…) after one untimed warm-up of each.

    Returns:
        mode → seconds from submit to claim, per repetition.
    """
    rng = random.Random(seed)
    tag = uuid.uuid4().hex[:6]
    records = {
        m: ApiRecords(api_url, token, f"bench-{m.replace('_', '-')}-{tag}", "local") for m in MODES
    }
    out: dict[str, list[float]] = {m: [] for m in MODES}
    with httpx.Client(base_url=api_url, timeout=30.0, trust_env=False) as http:
        try:
            for rec in records.values():
                rec.register(host="bench", pid=os.getpid(), capacity={"slots": 1, "gpus": []})
            for m in MODES:
                submit_to_claim_s(records[m], http, m, rng)
            for _ in range(reps):
                for m in MODES:
                    out[m].append(submit_to_claim_s(records[m], http, m, rng))
        finally:
            for rec in records.values():
                rec.close()
    return out


@contextlib.contextmanager
def database(dialect: str, workdir: Path) -> Iterator[str]:
    """A fresh database URL: a SQLite file under ``workdir`` or a throwaway PostgreSQL schema."""
    if dialect == "sqlite":
        yield common.sqlite_url(workdir)
    else:
        with common.pg_schema() as url:
            yield url


def worker_tokens(url: str, count: int, name: str) -> list[str]:
    """Migrate ``url`` and mint ``count`` worker tokens (``name-<i>``)."""
    db = common.migrated(url)
    try:
        return [create_worker_token(db, name=f"{name}-{i}").token for i in range(count)]
    finally:
        db.dispose()


def latency_part(size: str, workdir: Path) -> dict[str, dict[str, Any]]:
    """Part 1 on each of SERVERS: per mode the latencies and their p50/p90 (milliseconds)."""
    reps = pick(size, 3, 25, 100)
    out: dict[str, dict[str, Any]] = {}
    for seed, (label, (dialect, procs)) in enumerate(SERVERS.items()):
        with database(dialect, workdir) as url:
            (token,) = worker_tokens(url, 1, "bench-latency")
            with common.serve_api(url, workdir, workers=procs) as api_url:
                lat = measure_latency(api_url, token, reps, seed)
        fig: dict[str, Any] = {"api_processes": procs, "reps": reps}
        for m, values in lat.items():
            ms = [round(1000 * v, 1) for v in values]
            fig[m] = {
                "p50_ms": round(percentile(ms, 50), 1),
                "p90_ms": round(percentile(ms, 90), 1),
                "max_ms": max(ms),
                "ms": ms,
            }
        out[label] = fig
    return out


# -- 2. the fleet ------------------------------------------------------------------------------


def phase_figures(ph: Phase, n_workers: int, lifecycle: bool, jobs: int) -> dict[str, Any]:
    """One fleet run's figures (rates over first release → last claim answered)."""
    claims = len(ph.claimed)
    elapsed_s = max(1e-9, ph.last_claim_at - ph.first_at)
    per_k = 1000 / claims if claims else 0.0
    assert ph.cpu0 is not None
    cpu1 = ph.cpu1 or ph.cpu0
    serve_s = common.cpu_delta(ph.cpu0[0], cpu1[0])
    pg_s = common.cpu_delta(ph.cpu0[1], cpu1[1])
    return {
        "workers": n_workers,
        "lifecycle": lifecycle,
        "jobs_queued": jobs,
        "claims": claims,
        "elapsed_s": round(elapsed_s, 2),
        "claims_per_s": round(claims / elapsed_s, 1),
        "requests": ph.requests,
        "requests_per_s": round(ph.requests / elapsed_s, 1),
        "duplicates": duplicates(ph.claimed),
        "empty_answers": ph.empty,
        "errors": len(ph.errors),
        "first_errors": ph.errors[:3],
        "serve_cpu_s": round(serve_s, 2),
        "serve_cpu_s_per_1k_claims": round(serve_s * per_k, 3),
        "claims_per_serve_cpu_s": round(claims / serve_s, 1) if serve_s else None,
        "postgres_cpu_s_per_1k_claims": round(pg_s * per_k, 3),
        "client_cpu_s_per_1k_claims": round((cpu1[2] - ph.cpu0[2]) * per_k, 3),
        "serve_cores_busy": round(serve_s / elapsed_s, 2),
    }


def fleet_part(size: str, workdir: Path) -> dict[str, Any]:
    """Part 2: each phase of PHASES (tiny: TINY_PHASES) ``reps`` times, interleaved, each on
    freshly queued jobs, against one ``ddpq serve --workers 2``."""
    jobs: int = pick(size, 120, 3000, 10_000)
    reps: int = pick(size, 1, 2, 3)
    phases = pick(size, TINY_PHASES, PHASES)
    app_name = f"ddpq_bench_{uuid.uuid4().hex[:8]}"
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in phases}
    idle: dict[str, dict[str, Any]] = {}
    idle_s: float = pick(size, 2.0, 5.0)
    submits: int = pick(size, 2, 10, 20)
    with common.pg_schema() as url:
        tokens = worker_tokens(url, FLEET_TOKENS, "bench-fleet")
        db = common.migrated(url)
        conninfo = common.PG_URL.replace("postgresql+psycopg://", "postgresql://")
        env = {"DDPQ_LEASE_S": FLEET_LEASE_S}
        serve_url = f"{url}&application_name={app_name}"  # pg_schema's URL has a query
        try:
            with common.serve_api(serve_url, workdir, workers=API_WORKERS, extra_env=env) as api:
                time.sleep(1.0)  # the processes' own start-up is not the run's CPU
                serve = common.serve_pids(int(api.rsplit(":", 1)[1]))
                # Untimed: both processes import and warm up before the first timed phase.
                common.queue_jobs(db, WARM_UP_JOBS)
                asyncio.run(run_phase(api, tokens, 10, WARM_UP_JOBS, True, "warm-up", serve))
                for rep in range(reps):
                    for name, n_workers, lifecycle in phases:
                        common.queue_jobs(db, jobs)
                        sampler = ConnectionSampler(conninfo, app_name)
                        try:
                            with sampler:
                                tag = f"{name}-r{rep}-{uuid.uuid4().hex[:4]}".replace("_", "-")
                                ph, spread = asyncio.run(
                                    run_phase(
                                        api, tokens, n_workers, jobs, lifecycle, tag, serve,
                                        FLEET_SLOTS,
                                    )
                                )  # fmt: skip
                        finally:
                            sampler.close()
                        fig = phase_figures(ph, n_workers, lifecycle, jobs)
                        fig["sockets_per_api_process"] = sorted(spread.values())
                        fig["api_db_connections_max"] = max(sampler.api, default=None)
                        fig["api_db_connections_p50"] = (
                            percentile(sampler.api, 50) if sampler.api else None
                        )
                        fig["api_db_backends_seen"] = len(sampler.api_backends)
                        fig["all_db_connections_max"] = max(sampler.database, default=None)
                        fig["all_db_sessions_opened"] = sampler.sessions_opened
                        fig["server_check"] = job_states(db, set(ph.claimed))
                        runs[name].append(fig)
                # The big and the small fleet again, on an empty queue (not repeated).
                rng = random.Random(11)
                for name, n_workers, _ in phases[:2]:
                    tag = f"idle-{n_workers}-{uuid.uuid4().hex[:4]}"
                    idle[name.split("_")[0]] = asyncio.run(
                        idle_fleet(
                            api, tokens, n_workers, tag, serve, idle_s, submits, rng, FLEET_SLOTS
                        )
                    )
        finally:
            db.dispose()
    return {
        "jobs_per_run": jobs,
        "reps": reps,
        "pool_connections": POOL_CONNECTIONS,
        "runs": runs,
        "idle": idle,
    }


def fleet_correct(run: dict[str, Any]) -> bool:
    """Every queued job claimed exactly once, and the database agrees."""
    check = run["server_check"]
    want = "succeeded" if run["lifecycle"] else "starting"
    return (
        run["duplicates"] == 0
        and run["claims"] == run["jobs_queued"]
        and check["states"] == {want: run["jobs_queued"]}
        and check["claim_events"] == run["jobs_queued"]
        and check["claimed_twice_by_events"] == check["attempt_above_1"] == 0
    )


def submits_of(idle: dict[str, Any]) -> int:
    """How many jobs an idle fleet's run submitted (each must be claimed once)."""
    return len(idle["submit_to_claim_ms"])


# -- the result --------------------------------------------------------------------------------


def run(size: str, workdir: Path | None = None) -> BenchResult:
    """Both parts at ``size``; ratios and goal verdicts as the module docstring says."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="ddpq-bench-worker-api-"))
    res = BenchResult("worker_api", size)
    load_start = round(os.getloadavg()[0], 2)
    latency = latency_part(size, workdir)
    fleet = fleet_part(size, workdir)
    res.figures = {
        "fleet_slots_per_worker": FLEET_SLOTS,
        "latency": latency,
        "fleet": fleet,
        "cpus": os.cpu_count(),
        "load_avg_1m_start": load_start,
        "load_avg_1m_end": round(os.getloadavg()[0], 2),
    }
    for label, fig in latency.items():
        lp, anchor = fig["long_poll"]["p50_ms"], fig["poll_0.2s"]["p50_ms"]
        res.ratios[f"{label}_long_poll_vs_poll_p50"] = ratio(lp, anchor)
        res.ratios[f"{label}_long_poll_p50_vs_100ms"] = ratio(lp, 1000 * GOAL_P50_S)
        res.goals[f"{label}_long_poll_p50<=100ms"] = lp <= 1000 * GOAL_P50_S
    runs = fleet["runs"]
    names = list(runs)
    for name in names:
        res.figures[f"{name}_claims_per_s_median"] = median([r["claims_per_s"] for r in runs[name]])
    # The big fleet running each job, the small one, the big one claiming only.
    main, small, claim_only = names
    res.figures["fleet_phases"] = {"fleet": main, "small_fleet": small, "claim_only": claim_only}
    # The goal is claims/s ("200 workers claim >= 500 jobs/s"): the claim-only phase. The
    # lifecycle phase adds each job's two transition requests: the API's jobs/s, a figure.
    rate = res.figures[f"{claim_only}_claims_per_s_median"]
    res.ratios["fleet_claim_only_claims_per_s_vs_500"] = ratio(rate, GOAL_CLAIMS_PER_S)
    res.ratios["fleet_lifecycle_jobs_per_s_vs_500"] = ratio(
        res.figures[f"{main}_claims_per_s_median"], GOAL_CLAIMS_PER_S
    )
    conns = {n: max((r["api_db_connections_max"] or 0) for r in runs[n]) for n in names}
    res.ratios["api_db_connections_max_vs_pools"] = ratio(max(conns.values()), POOL_CONNECTIONS)
    res.ratios["api_db_connections_big_vs_small_fleet"] = ratio(conns[main], conns[small])
    idle = fleet["idle"]
    for label, fig in idle.items():  # w200 / w50 (tiny: w40 / w10)
        res.figures[f"idle_{label}_serve_cores_busy"] = fig["idle_serve_cores_busy"]
    big_idle = idle[main.split("_")[0]]
    p50 = big_idle["submit_to_claim_p50_ms"]
    res.ratios["idle_fleet_long_poll_p50_vs_100ms"] = ratio(p50, 1000 * GOAL_P50_S)
    res.goals["idle_fleet_long_poll_p50<=100ms"] = p50 is not None and p50 <= 1000 * GOAL_P50_S
    every = [r for n in names for r in runs[n]]
    res.goals["fleet_claims_per_s>=500"] = rate >= GOAL_CLAIMS_PER_S
    res.goals["fleet_no_duplicates"] = all(fleet_correct(r) for r in every) and all(
        f["duplicates"] == 0 and f["claimed"] == submits_of(f) for f in idle.values()
    )
    res.goals["fleet_no_errors"] = all(r["errors"] == 0 for r in [*every, *idle.values()])
    res.goals[f"api_db_connections<={POOL_CONNECTIONS}"] = max(conns.values()) <= POOL_CONNECTIONS
    res.notes += [
        f"latency: the long poll is ApiRecords.claim(0, wait_s={MAX_CLAIM_WAIT_S:g}) in a loop "
        "(worker.loop's _pause); the anchor emulates the previous loop's has_claimable_job "
        f"read every {ANCHOR_POLL_S:g} s then claim as a wait_s=0 claim every {ANCHOR_POLL_S:g} s "
        "over the same API (one request instead of read + claim, and over HTTP where the old "
        "worker read the database itself). The job is submitted (POST /api/v1/jobs) at a "
        "random moment 0.25-1.25 s into the wait; time = submit request start -> claim answer "
        "in the worker's thread. pg_2procs: ddpq serve --workers 2, so the submission may reach "
        "the other process, whose waiting claim only the 0.1 s probe wakes.",
        "fleet: one asyncio process, one keep-alive HTTP/1.1 connection per simulated worker "
        f"(a bare client: httpx's CPU would come off the server's 2 cores), ids over "
        f"{FLEET_TOKENS} worker tokens, each of {FLEET_SLOTS} slots looping "
        f"claim(limit={FLEET_SLOTS}, wait_s=1); *_lifecycle: each job claimed then starting "
        "-> running -> succeeded (2 requests per job besides the claim), *_claim_only: claims "
        f"alone. Leases {FLEET_LEASE_S} s. claims/s over first release -> last claim answered. "
        "Connections: pg_stat_activity rows of the API's application_name, sampled every "
        f"50 ms; pools = {API_WORKERS} processes x (pool_size + max_overflow = "
        f"{2 * PG_POOL_SIZE}); api_db_backends_seen: distinct backends of the API in those "
        "samples (more than the max: connections opened and closed meanwhile, the pools' "
        "overflow). idle_*: the big and the small fleet long-polling an empty queue (its "
        "cost over 5 s, tiny 2 s), then jobs POSTed one at a time at random moments: submit "
        "start -> the answer carrying it, as the fleet's event loop saw it. CPU from /proc: "
        "serve = the server and its worker processes, "
        "postgres = every postgres process on the box; client and server share the box.",
    ]
    return res


def main() -> None:
    """CLI: ``python -m bench.worker_api --size tiny``."""
    cli_main(run, __doc__ or "")


if __name__ == "__main__":
    main()
