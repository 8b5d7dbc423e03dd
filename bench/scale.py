"""Benchmark #7: scale by simulation. Many simulated rank-0 sinks (one asyncio process, a
bounded HTTP/1.1 pool) report 10 points/s each through ``ddpq serve --workers 2`` into
PostgreSQL while dashboard pollers read the points back: every point stored exactly once,
lag from report to visible, poll p99, and where the server's time goes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text

from bench import common
from bench.common import BenchResult, percentile, pick, ratio
from service.core.wire import attempt as wire
from service.store import migrate
from service.store.db import Database
from worker.runtime.metrics.buffer import FLUSH_EVERY_POINTS, FLUSH_INTERVAL_S

API_WORKERS = 2
POINTS_PER_S = 10.0  # per simulated sink
SINK_CONNECTIONS = 128  # the sinks' sockets in all: 1,000 sockets on 2 cores is the point
# httpcore's pool scans every connection per queued request (quadratic): the sinks share 8
# clients of 16 connections, and a semaphore per client keeps its queue empty.
SINK_POOLS = 8
POLLER_START_S = 4.0  # for the pollers' process to start (spawn, imports)
LOOP_TICK_S = 0.01  # the load process's event-loop probe (how late a 10 ms sleep wakes)
POLLERS = 8
POLL_PERIOD_S = 0.25  # how often one watched job is polled (the lag's resolution)
WATCHED_JOBS = 32  # jobs the pollers follow: 128 polls/s in all, as a few dashboards
ERROR_BACKOFF_S = 0.5  # before a batch is sent again after a transport error or a 5xx
TAIL_TIMEOUT_S = 30.0  # after the load: for the last acks and the pollers' last sightings
GOAL_LAG_P99_S = 2.0
GOAL_POLL_P99_S = 0.050


@dataclass
class Stats:
    """What the load process saw (latencies in seconds, times on ``time.time()``)."""

    sent: dict[int, int] = field(default_factory=dict)  # job → points acknowledged
    inserted: int = 0  # the acks' ``inserted`` summed (a resend inserts 0)
    posts: int = 0
    rejected_429: int = 0
    errors: int = 0  # transport errors and 5xx, each retried
    fatal: list[str] = field(default_factory=list)  # 409/422: the sink stopped
    post_s: list[float] = field(default_factory=list)  # request latency on a connection
    pool_wait_s: list[float] = field(default_factory=list)  # waiting for a free connection
    loop_late_s: list[float] = field(default_factory=list)  # the load process's loop lag
    batch_points: list[int] = field(default_factory=list)
    poll_s: list[float] = field(default_factory=list)
    lag_s: list[float] = field(default_factory=list)  # report → seen by a poller
    post_to_visible_s: list[float] = field(default_factory=list)  # first POST → seen
    report_to_post_s: list[float] = field(default_factory=list)  # report → first POST
    posted_at: dict[int, dict[int, float]] = field(default_factory=dict)  # watched job → step
    wire_format: str = "series"  # how the sinks send points: "series" (columns) or "rows"


@dataclass
class Timing:
    """Seconds of one load run: wall clock and CPU (``/proc``) of the phases."""

    polls_only: int = 0  # polls answered in that phase
    serve_cpu_polls_only_s: float = 0.0
    drain_s: float = 0.0  # from the end of the points to the last sink's last ack
    serve_cpu_s: float = 0.0  # the load phase (sinks and pollers)
    postgres_cpu_s: float = 0.0
    load_cpu_s: float = 0.0
    load_wall_s: float = 0.0  # the window those three CPU figures cover


Pool = tuple[httpx.AsyncClient, asyncio.Semaphore]


def batch_body(steps: list[int], t0: float, wire_format: str) -> str:
    """A sink's batch of ``loss`` at ``steps`` (each at its step's time) as the rank's
    client sends it: columns (``MetricSeries``, as ``ApiSink`` does) or, for a server that
    predates them, rows."""
    times = [t0 + (s - 1) / POINTS_PER_S for s in steps]
    if wire_format == "rows":
        rows = [("loss", s, 0, 0.5, t) for s, t in zip(steps, times, strict=True)]
        return wire.MetricBatch(points=rows).model_dump_json(exclude_defaults=True)
    series = wire.MetricSeries(name="loss", steps=steps, values=[0.5] * len(steps),
                               times_s=times, epochs=[0] * len(steps))  # fmt: skip
    return wire.MetricBatch(series=[series]).model_dump_json(exclude_defaults=True)


async def sink(pool: Pool, job_id: int, token: str, t0: float, end: float, st: Stats) -> None:
    """One simulated rank 0: a point every 1/POINTS_PER_S s from ``t0`` (its time_s = when
    the step produced it), buffered and POSTed every FLUSH_INTERVAL_S (or FLUSH_EVERY_POINTS)
    as ApiSink does; a batch is resent until acknowledged (429: after Retry-After; errors:
    after ERROR_BACKOFF_S) and never dropped, so each point is stored exactly once."""
    headers = {"Authorization": f"Bearer {token}"}
    watched = st.posted_at.get(job_id)
    next_step = 1
    flush_at = t0 + random.uniform(0, FLUSH_INTERVAL_S)  # real jobs do not flush in step
    while True:
        # The last batch goes at the sink's own next flush after ``end`` too: a stop at one
        # instant for every sink would be a burst no real fleet sends.
        await asyncio.sleep(max(0.0, flush_at - time.time()))
        now = time.time()
        produced = int((min(now, end) - t0) * POINTS_PER_S)  # steps 1..produced exist by now
        last = min(produced, next_step - 1 + FLUSH_EVERY_POINTS)
        steps = list(range(next_step, last + 1))
        if steps:
            body = batch_body(steps, t0, st.wire_format)
            if watched is not None:
                watched.update((s, now) for s in range(next_step, last + 1))
            client, free = pool
            while True:
                waited_at = time.perf_counter()
                try:
                    async with free:
                        sent_at = time.perf_counter()
                        st.pool_wait_s.append(sent_at - waited_at)
                        resp = await client.post(
                            f"/api/v1{wire.METRICS_PATH}", content=body, headers=headers
                        )
                except httpx.TransportError:
                    st.errors += 1
                    await asyncio.sleep(ERROR_BACKOFF_S)
                    continue
                st.posts += 1
                st.post_s.append(time.perf_counter() - sent_at)
                if resp.status_code == 200:
                    break
                if resp.status_code == 429:
                    st.rejected_429 += 1
                    await asyncio.sleep(float(resp.headers.get("Retry-After", "1")))
                elif resp.status_code >= 500:
                    st.errors += 1
                    await asyncio.sleep(ERROR_BACKOFF_S)
                else:  # 409 superseded / 422 malformed: a real rank stops here
                    st.fatal.append(f"job {job_id}: {resp.status_code} {resp.text[:200]}")
                    return
            ack = wire.MetricBatchAck.model_validate_json(resp.content)
            st.inserted += ack.inserted
            st.sent[job_id] = st.sent.get(job_id, 0) + len(steps)
            st.batch_points.append(len(steps))
            next_step = last + 1
        if now >= end and next_step > int((end - t0) * POINTS_PER_S):
            return  # close(): everything produced before ``end`` is acknowledged
        flush_at = max(flush_at + FLUSH_INTERVAL_S, now if last < produced else 0.0)


Polls = list[tuple[float, float]]  # (answered at on time.time(), latency s)
Seen = list[tuple[int, int, float]]  # (job, step, answered at): each point's first sighting


def dashboards(api_url: str, watched: dict[int, tuple[float, int]], until: float, out: Any) -> None:
    """The pollers' own process (a dashboard is another client: the sinks' event loop must
    not delay its polls); puts ``(polls, seen)`` on ``out``. ``watched``: job → (its first
    point's time_s, its last step); polling ends once every last step is seen, or at
    ``until`` (time.time())."""
    polls: Polls = []
    seen: Seen = []
    jobs = sorted(watched)
    shares = [jobs[i::POLLERS] for i in range(POLLERS) if jobs[i::POLLERS]]

    async def main() -> None:
        async with httpx.AsyncClient(base_url=api_url, timeout=60.0) as client:
            await asyncio.gather(*(_poller(client, j, watched, until, polls, seen) for j in shares))

    asyncio.run(main())
    out.put((polls, seen))


async def _poller(
    client: httpx.AsyncClient, jobs: list[int], watched: dict[int, tuple[float, int]],
    until: float, polls: Polls, seen: Seen,
) -> None:  # fmt: skip
    """Round-robin over ``jobs``, each polled every POLL_PERIOD_S from the last step seen."""
    cursor = dict.fromkeys(jobs, 0)
    gap = POLL_PERIOD_S / len(jobs)
    while time.time() < until and any(cursor[j] < watched[j][1] for j in jobs):
        for job_id in jobs:
            t_start = time.perf_counter()
            resp = await client.get(
                f"/api/v1/jobs/{job_id}/metrics",
                params={"name": "loss", "after_step": cursor[job_id]},
            )
            latency = time.perf_counter() - t_start
            answered = time.time()  # an upper bound of when the rows became visible
            polls.append((answered, latency))
            resp.raise_for_status()
            body = resp.json()
            seen.extend((job_id, int(pt["step"]), answered) for pt in body["points"])
            cursor[job_id] = max(cursor[job_id], int(body["next_after_step"]))
            await asyncio.sleep(max(0.0, gap - latency))


async def loop_probe(stop: asyncio.Event, st: Stats) -> None:
    """How late this process's loop wakes a LOOP_TICK_S sleep (it inflates POST latencies)."""
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(LOOP_TICK_S)
        st.loop_late_s.append(time.perf_counter() - t - LOOP_TICK_S)


async def load(
    api_url: str, tokens: dict[int, str], duration_s: float, calibrate_s: float, st: Stats,
    serve: list[int],
) -> Timing:  # fmt: skip
    """The pollers alone for ``calibrate_s`` (the server's CPU per poll), then every sink for
    ``duration_s`` with the pollers, until the watched jobs' last points are seen (or
    TAIL_TIMEOUT_S after the last ack). ``serve``: the server's pids (CPU counted)."""
    jobs = sorted(tokens)
    watched = random.Random(7).sample(jobs, min(WATCHED_JOBS, len(jobs)))
    st.posted_at = {j: {} for j in watched}
    per_pool = SINK_CONNECTIONS // SINK_POOLS
    limits = httpx.Limits(max_connections=per_pool, max_keepalive_connections=per_pool)
    tm = Timing()
    cal_start = time.time() + POLLER_START_S
    t0 = cal_start + calibrate_s + 1.0  # the pollers' phase, then a second to start
    end = t0 + duration_s
    # Each sink starts its steps a little apart, as independent jobs do.
    starts = {j: t0 + random.uniform(0, 1 / POINTS_PER_S) for j in jobs}
    # The last step as the sink computes it (the same float expression).
    watch = {j: (starts[j], int((end - starts[j]) * POINTS_PER_S)) for j in watched}
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    until = end + FLUSH_INTERVAL_S + TAIL_TIMEOUT_S
    dash = ctx.Process(target=dashboards, args=(api_url, watch, until, out), daemon=True)
    dash.start()
    async with contextlib.AsyncExitStack() as stack:
        pools = [
            (
                await stack.enter_async_context(
                    httpx.AsyncClient(base_url=api_url, limits=limits, timeout=60.0)
                ),
                asyncio.Semaphore(per_pool),
            )
            for _ in range(SINK_POOLS)
        ]
        await asyncio.sleep(max(0.0, cal_start - time.time()))
        cal0 = common.cpu_s(serve)
        await asyncio.sleep(max(0.0, cal_start + calibrate_s - time.time()))
        tm.serve_cpu_polls_only_s = common.cpu_delta(cal0, common.cpu_s(serve))
        # Postgres backends the server opens during the load count from 0 (cpu_delta).
        cpu0 = (common.cpu_s(serve), common.cpu_s(common.postgres_pids()), time.process_time())
        w0, load_start = time.perf_counter(), time.time()
        stop = asyncio.Event()
        probe = asyncio.create_task(loop_probe(stop, st))
        await asyncio.gather(
            *(sink(pools[j % SINK_POOLS], j, tokens[j], starts[j], end, st) for j in jobs)
        )
        tm.drain_s = (load_end := time.time()) - end
        stop.set()
        await probe
        wait_s = until - time.time() + TAIL_TIMEOUT_S  # past it: queue.Empty (pollers died)
        polls, seen = await asyncio.get_running_loop().run_in_executor(None, out.get, True, wait_s)
        dash.join()
        cpu1 = (common.cpu_s(serve), common.cpu_s(common.postgres_pids()), time.process_time())
        tm.load_wall_s = time.perf_counter() - w0
    tm.serve_cpu_s = common.cpu_delta(cpu0[0], cpu1[0])
    tm.postgres_cpu_s = common.cpu_delta(cpu0[1], cpu1[1])
    tm.load_cpu_s = cpu1[2] - cpu0[2]
    tm.polls_only = sum(1 for t, _ in polls if cal_start <= t < load_start)
    st.poll_s = [lat for t, lat in polls if load_start <= t <= load_end]  # during the load
    for job_id, step, answered in seen:
        reported = starts[job_id] + (step - 1) / POINTS_PER_S  # the row's time_s
        st.lag_s.append(answered - reported)
        if (posted := st.posted_at[job_id].pop(step, None)) is not None:
            st.post_to_visible_s.append(answered - posted)
            st.report_to_post_s.append(posted - reported)
    return tm


def pct(values: list[float], q: float, scale: float = 1.0, digits: int = 3) -> float | None:
    """The ``q``-th percentile × ``scale``, rounded; None when nothing was measured."""
    return round(scale * percentile(values, q), digits) if values else None


def stored_counts(db: Database) -> dict[int, tuple[int, int, int]]:
    """job → (rows, distinct steps, max step) of its ``loss`` points in the table."""
    with db.session(write=False) as session:
        rows = session.execute(
            text(
                "SELECT job_id, count(*), count(DISTINCT step), max(step) FROM metrics "
                "WHERE name = 'loss' GROUP BY job_id"
            )
        ).all()
    return {int(r[0]): (int(r[1]), int(r[2]), int(r[3])) for r in rows}


def _head_of(root: Path) -> str:
    """The newest migration of the checkout at ``root`` (its file name's revision prefix,
    ``NNNN_…``: the project numbers its revisions in order)."""
    names = sorted(p.name for p in (root / "migrations" / "versions").glob("[0-9]*_*.py"))
    if not names:
        raise RuntimeError(f"{root}: no migrations/versions/NNNN_*.py")
    return names[-1].split("_", 1)[0]


def run(
    size: str,
    workdir: Path | None = None,
    *,
    sinks: int | None = None,
    duration_s: float | None = None,
    server_root: Path | None = None,
    wire_format: str = "series",
) -> BenchResult:
    """Sinks × 10 points/s through ``ddpq serve --workers 2`` for the size's duration.

    ``sinks``/``duration_s`` override the size's (a knee ladder runs several sizes);
    ``server_root``: serve another checkout's code (put first on the server's PYTHONPATH),
    e.g. an older commit measured in the same run; ``wire_format``: the sinks' body,
    ``series`` (columns, as ``ApiSink`` sends) or ``rows`` (what servers before columns
    read).

    Raises:
        RuntimeError: a sink was refused with 409/422 (the set-up is wrong, not the load).
    """
    n_sinks: int = sinks if sinks is not None else pick(size, 50, 1000)
    duration_s = duration_s if duration_s is not None else pick(size, 5.0, 60.0, 120.0)
    calibrate_s: float = pick(size, 1.0, 5.0)
    workdir = workdir or Path(tempfile.mkdtemp(prefix="ddpq-bench-scale-"))
    res = BenchResult("scale", size)
    st = Stats(wire_format=wire_format)
    with common.pg_schema() as url:
        db = common.migrated(url)  # before the server starts: it refuses an unmigrated database
        if server_root is not None:  # that checkout's schema: it refuses a newer one
            migrate.downgrade(db.engine, _head_of(server_root))
        t_setup = time.perf_counter()
        tokens = common.running_jobs(db, n_sinks)
        setup_s = time.perf_counter() - t_setup
        server_env = None
        if server_root is not None:  # safe path: no cwd (this checkout) before PYTHONPATH
            server_env = {"PYTHONPATH": str(server_root), "PYTHONSAFEPATH": "1"}
        with common.serve_api(url, workdir, workers=API_WORKERS, extra_env=server_env) as api_url:
            port = int(api_url.rsplit(":", 1)[1])
            time.sleep(1.0)  # the workers' own start-up is not the load's CPU
            serve = common.serve_pids(port)
            tm = asyncio.run(load(api_url, tokens, duration_s, calibrate_s, st, serve))
        counts = stored_counts(db)
        db.dispose()
    if st.fatal:
        raise RuntimeError(f"{len(st.fatal)} sinks refused: {st.fatal[:3]}")
    sent = sum(st.sent.values())
    stored = sum(c[0] for c in counts.values())
    missing = sum(max(0, n - counts.get(j, (0, 0, 0))[1]) for j, n in st.sent.items())
    doubled = sum(rows - distinct for rows, distinct, _ in counts.values())
    # Stored but never acknowledged (e.g. a step past what the sink sent): not exactly once.
    extra = sum(max(0, top - st.sent.get(j, 0)) for j, (_, _, top) in counts.items())
    exactly_once = missing == 0 and doubled == 0 and extra == 0 and stored == sent
    per_k = 1000 / stored if stored else 0.0
    # Points are produced for duration_s; a sink that keeps up acks its last within a flush
    # interval of the end, so only a longer drain (the server behind) stretches the time.
    rate = stored / (duration_s + max(0.0, tm.drain_s - FLUSH_INTERVAL_S))
    # The server's CPU split: per poll from the pollers-only phase, the rest is the POSTs'.
    per_poll = tm.serve_cpu_polls_only_s / max(1, tm.polls_only)
    post_cpu = max(0.0, tm.serve_cpu_s - per_poll * len(st.poll_s))
    lag_p99, poll_p99 = pct(st.lag_s, 99), pct(st.poll_s, 99, digits=4)
    res.figures = {
        "sinks": n_sinks,
        "wire": wire_format,
        "server_code": str(server_root) if server_root is not None else "this checkout",
        "duration_s": duration_s,
        "setup_s": round(setup_s, 1),
        "load_wall_s": round(tm.load_wall_s, 1),
        "drain_s": round(tm.drain_s, 2),
        "points_sent": sent,
        "points_stored": stored,
        "acks_inserted": st.inserted,
        "missing": missing,
        "duplicates": doubled,
        "unacknowledged_stored": extra,
        "points_per_s_stored": round(rate),
        "points_per_s_per_api_process": round(rate / API_WORKERS),
        "posts": st.posts,
        "posts_per_s": round(st.posts / duration_s),
        "batch_points_median": pct([float(n) for n in st.batch_points], 50),
        "rejected_429": st.rejected_429,
        "transport_or_5xx_errors": st.errors,
        "polls": len(st.poll_s),
        "lag_points_seen": len(st.lag_s),
        "serve_cpu_s": round(tm.serve_cpu_s, 2),
        "serve_cores_busy": round(tm.serve_cpu_s / tm.load_wall_s, 2),
        "serve_cpu_ms_per_poll": round(1000 * per_poll, 2),
        "serve_cpu_ms_per_post": round(1000 * post_cpu / max(1, st.posts), 2),
        "serve_cpu_s_per_1k_points": round(post_cpu * per_k, 4),
        "points_per_serve_cpu_s": round(stored / post_cpu) if post_cpu else None,
        "postgres_cores_busy": round(tm.postgres_cpu_s / tm.load_wall_s, 2),
        "postgres_cpu_s_per_1k_points": round(tm.postgres_cpu_s * per_k, 4),
        "load_process_cores_busy": round(tm.load_cpu_s / tm.load_wall_s, 2),
        "load_process_cpu_s_per_1k_points": round(tm.load_cpu_s * per_k, 4),
        "cpus": os.cpu_count(),
        "load_avg_1m_end": round(os.getloadavg()[0], 2),
    }
    spreads = {  # name → (values, scale); milliseconds for latencies, seconds for lags
        "post_ms": (st.post_s, 1000.0),  # on a connection, 429s included
        "pool_wait_ms": (st.pool_wait_s, 1000.0),
        "load_loop_late_ms": (st.loop_late_s, 1000.0),
        "poll_ms": (st.poll_s, 1000.0),
        "lag_s": (st.lag_s, 1.0),  # = report_to_post (the sink's buffer) + post_to_visible
        "report_to_post_s": (st.report_to_post_s, 1.0),
        "post_to_visible_s": (st.post_to_visible_s, 1.0),
    }
    for key, (values, scale) in spreads.items():
        for q in (50, 99):
            res.figures[f"{key}_p{q}"] = pct(values, q, scale, 1 if scale > 1 else 3)
    res.ratios = {
        "stored_vs_sent": ratio(stored, sent),
        "stored_rate_vs_offered": ratio(rate, sent / duration_s),
        "lag_p99_vs_goal": ratio(lag_p99, GOAL_LAG_P99_S),
        "poll_p99_vs_goal": ratio(poll_p99, GOAL_POLL_P99_S),
    }
    res.goals = {
        "exactly_once": exactly_once,
        "lag_p99<=2s": None if lag_p99 is None else lag_p99 <= GOAL_LAG_P99_S,
        "poll_p99<=50ms": None if poll_p99 is None else poll_p99 <= GOAL_POLL_P99_S,
    }
    res.notes.append(
        f"{n_sinks} simulated rank-0 sinks in one asyncio process (httpx, HTTP/1.1, "
        f"{SINK_CONNECTIONS} connections), {POINTS_PER_S:g} points/s each, a batch per "
        f"FLUSH_INTERVAL_S = {FLUSH_INTERVAL_S:g} s as ApiSink, resent on 429/errors until "
        f"acked; {POLLERS} pollers (own process) over {min(WATCHED_JOBS, n_sinks)} jobs, each "
        f"every {POLL_PERIOD_S:g} s. lag = poll answer − the point's time_s (its report). "
        "exactly once: per job, rows = distinct steps = steps acked. CPU from /proc: serve = "
        "server + workers, postgres = every postgres process on the box, load = the sinks' "
        "process; all share the box."
    )
    return res


def main() -> None:
    """CLI: ``python -m bench.scale --size tiny`` (``--sinks``, ``--duration-s``,
    ``--server-root``, ``--wire`` as ``run`` takes them)."""
    p = common.parser(__doc__ or "")
    p.add_argument("--sinks", type=int, default=None, help="simulated sinks (the size's)")
    p.add_argument("--duration-s", type=float, default=None, help="load seconds (the size's)")
    p.add_argument("--server-root", type=Path, default=None, help="serve this checkout's code")
    p.add_argument("--wire", choices=("series", "rows"), default="series", help="sinks' body")
    args = p.parse_args()
    res = run(args.size, sinks=args.sinks, duration_s=args.duration_s,
              server_root=args.server_root, wire_format=args.wire)  # fmt: skip
    text_ = json.dumps(res.as_dict(), indent=2)
    if args.json:
        args.json.write_text(text_)
    sys.stdout.write(text_ + "\n")


if __name__ == "__main__":
    main()
