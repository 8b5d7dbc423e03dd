"""Benchmark #11's second part: a fleet of simulated workers long-polling the worker API of
``ddpq serve --workers 2`` over PostgreSQL, each on its own keep-alive connection; claims/s,
duplicate claims, the API's database connections and its CPU per claim; and the same fleet
idle: what its waiting costs, and how soon one of them takes a job submitted then."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
from sqlalchemy import text

from bench import common
from bench.common import percentile
from service.core.holds import Transition
from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.core.wire.worker import (
    CLAIM_PATH,
    REGISTER_PATH,
    TRANSITIONS_PATH,
    WORKER_ID_HEADER,
    Capacity,
    ClaimIn,
    RegisterIn,
    TransitionIn,
)
from service.store.db import Database

CLAIM_WAIT_S = 1.0  # each claim's long poll, as worker.loop's MAX_CLAIM_WAIT_S
SAMPLE_EVERY_S = 0.05  # pg_stat_activity sampling period
ERROR_BACKOFF_S = 0.1


def claim_body(slots: int) -> bytes:
    """A simulated worker's claim: every slot free (its jobs end as soon as they start), so
    up to ``slots`` jobs per request, as ``worker.loop`` asks with that many free slots."""
    return ClaimIn(max_gpus_per_node=0, limit=slots, wait_s=CLAIM_WAIT_S).model_dump_json().encode()


class HttpError(RuntimeError):
    """A connection answered something this client does not read (no Content-Length)."""


class Connection:
    """One keep-alive HTTP/1.1 connection with fixed headers: a simulated worker's.

    A bare asyncio client, as bench/api.py's load: httpx costs ~0.6 ms of CPU per request,
    which on a 2-core box is taken from the server being measured (here three requests per
    job, 200 connections).
    """

    def __init__(self, host: str, port: int, headers: dict[str, str]) -> None:
        self.host, self.port = host, port
        self._head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def call(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        """Send one request and read its answer: ``(status, body)``.

        Raises:
            OSError, asyncio.IncompleteReadError: the connection failed (it is dropped and
                the next call opens a new one; the request is not sent again).
            HttpError: an answer without Content-Length.
        """
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        assert self._reader is not None
        head = (
            f"{method} {API_PREFIX}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"{self._head}Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        try:
            self._writer.write(head.encode() + body)
            raw = await self._reader.readuntil(b"\r\n\r\n")
            lines = raw.decode("latin-1").split("\r\n")
            length = next(
                (int(x.split(":", 1)[1]) for x in lines if x.lower().startswith("content-length:")),
                None,
            )
            if length is None:
                raise HttpError(f"{method} {path}: no Content-Length in {lines[0]!r}")
            return int(lines[0].split(" ")[1]), await self._reader.readexactly(length)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the socket (the next call reconnects)."""
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


@dataclass
class Phase:
    """What one fleet run saw."""

    claimed: list[int] = field(default_factory=list)  # job ids, in answer order
    empty: int = 0  # claim answers with no job (their long poll ran out)
    requests: int = 0
    errors: list[str] = field(default_factory=list)  # non-2xx answers, transport errors
    first_at: float = 0.0  # perf_counter: the fleet released
    last_claim_at: float = 0.0  # perf_counter: the last answer carrying a job
    serve: list[int] = field(default_factory=list)  # the API's pids (CPU counted)
    cpu0: Snapshot | None = None  # at the release
    cpu1: Snapshot | None = None  # when the last queued job was claimed


Snapshot = tuple[dict[int, float], dict[int, float], float]


def cpu_snapshot(serve: list[int]) -> Snapshot:
    """CPU seconds so far of the API's processes, of every postgres process, and of this one."""
    return common.cpu_s(serve), common.cpu_s(common.postgres_pids()), time.process_time()


def _transition_body(job_id: int, expected: JobState, target: JobState) -> bytes:
    t = Transition(job_id, expected, target, "bench")
    return TransitionIn(transition=t).model_dump_json().encode()


async def simulated_worker(
    conn: Connection, ph: Phase, target: int, lifecycle: bool, deadline: float, slots: int = 1
) -> None:
    """Claim up to ``slots`` jobs at a time (a 1 s long poll) until ``target`` jobs are
    claimed fleet-wide and a poll comes back empty (or ``deadline``); with ``lifecycle``,
    each job goes starting → running → succeeded at once, as a job that ends the moment it
    starts (its slot free again for the next claim)."""
    steps = ((JobState.STARTING, JobState.RUNNING), (JobState.RUNNING, JobState.SUCCEEDED))
    claim = claim_body(slots)
    while time.perf_counter() < deadline:
        try:
            status, body = await conn.call("POST", CLAIM_PATH, claim)
            ph.requests += 1
            if status != 200:
                ph.errors.append(f"claim {status} {body[:200]!r}")
                await asyncio.sleep(ERROR_BACKOFF_S)
                continue
            jobs = json.loads(body)["jobs"]
            if not jobs:
                ph.empty += 1
                if len(ph.claimed) >= target:
                    return
                continue
            job_ids = [int(j["job_id"]) for j in jobs]
            before = len(ph.claimed)
            ph.claimed.extend(job_ids)
            ph.last_claim_at = time.perf_counter()
            if before < target <= len(ph.claimed):
                ph.cpu1 = cpu_snapshot(ph.serve)
            for job_id in job_ids if lifecycle else ():
                for expected, next_state in steps:
                    body_t = _transition_body(job_id, expected, next_state)
                    status, body = await conn.call("POST", TRANSITIONS_PATH, body_t)
                    ph.requests += 1
                    if status != 200:
                        ph.errors.append(f"transition {status} {body[:200]!r}")
        except (OSError, asyncio.IncompleteReadError, HttpError) as exc:
            ph.errors.append(f"transport {type(exc).__name__}: {exc}")
            await asyncio.sleep(ERROR_BACKOFF_S)


class ConnectionSampler:
    """Samples PostgreSQL's connections every SAMPLE_EVERY_S from its own connection (a
    thread): those of ``application_name`` (the API's: how many, and which backends) and all
    of this database (other sessions' tests included), less its own; and the sessions the
    database opened meanwhile (``pg_stat_database.sessions``, every client's)."""

    def __init__(self, conninfo: str, application_name: str) -> None:
        self._conn = psycopg.connect(conninfo, autocommit=True)
        self._name = application_name
        self.api: list[int] = []
        self.database: list[int] = []
        self.api_backends: set[int] = set()  # backend pids seen: more than the max = churn
        self.sessions_opened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> tuple[int, int]:
        """(the API's connections, every connection to this database but this one) now."""
        row = self._conn.execute(
            "SELECT array_agg(pid) FILTER (WHERE application_name = %s), count(*) - 1 "
            "FROM pg_stat_activity WHERE datname = current_database()",
            (self._name,),
        ).fetchone()
        assert row is not None
        pids = row[0] or []
        self.api_backends.update(pids)
        return len(pids), int(row[1])

    def _sessions(self) -> int:
        row = self._conn.execute(
            "SELECT sessions FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        return int(row[0]) if row else 0

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            api, every = self.sample()
            self.api.append(api)
            self.database.append(every)

    def __enter__(self) -> ConnectionSampler:
        self._sessions0 = self._sessions()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sessions_opened = self._sessions() - self._sessions0

    def close(self) -> None:
        """Close its connection."""
        self._conn.close()


def api_sockets_per_pid(port: int, pids: list[int]) -> dict[int, int]:
    """pid → established TCP connections it holds on local ``port`` (IPv4 loopback; from
    /proc/net/tcp and each process's fds): how the kernel spread the fleet over the API's
    processes."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":  # ESTABLISHED
            inodes.add(f"socket:[{fields[9]}]")
    out = {}
    for pid in pids:
        n = 0
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    n += fd.readlink().as_posix() in inodes
        if n:
            out[pid] = n
    return out


async def _register(conns: list[Connection], slots: int) -> None:
    body = RegisterIn(host="bench", pid=0, launcher="local", capacity=Capacity(slots=slots))
    data = body.model_dump_json().encode()
    answers = await asyncio.gather(*(c.call("PUT", REGISTER_PATH, data) for c in conns))
    bad = [(s, b[:200]) for s, b in answers if s != 200]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(conns)} registrations failed: {bad[:3]}")


def connections(api_url: str, tokens: list[str], n_workers: int, tag: str) -> list[Connection]:
    """One connection per simulated worker (ids ``<tag>-<i>``, tokens round-robin)."""
    host, port = api_url.removeprefix("http://").rsplit(":", 1)
    return [
        Connection(host, int(port), {
            "Authorization": f"Bearer {tokens[i % len(tokens)]}",
            WORKER_ID_HEADER: f"{tag}-{i}",
        })
        for i in range(n_workers)
    ]  # fmt: skip


async def run_phase(
    api_url: str, tokens: list[str], n_workers: int, jobs: int, lifecycle: bool, tag: str,
    serve: list[int], slots: int = 1,
) -> tuple[Phase, dict[int, int]]:  # fmt: skip
    """Register ``n_workers`` simulated workers of ``slots`` slots each, then release them
    together on ``jobs`` queued jobs; ``serve``: the API's pids.

    Returns:
        What the phase saw, and pid → the API's sockets per process after registration.
    """
    conns = connections(api_url, tokens, n_workers, tag)
    try:
        await _register(conns, slots)
        port = conns[0].port
        spread = api_sockets_per_pid(port, common.serve_pids(port))
        ph = Phase(serve=serve, cpu0=cpu_snapshot(serve), first_at=time.perf_counter())
        # Generous: 20 claims/s would be far below any box this runs on.
        deadline = ph.first_at + 30.0 + jobs / 20.0
        await asyncio.gather(
            *(simulated_worker(c, ph, jobs, lifecycle, deadline, slots) for c in conns)
        )
    finally:
        for c in conns:
            c.close()
    return ph, spread


async def idle_fleet(
    api_url: str, tokens: list[str], n_workers: int, tag: str, serve: list[int],
    idle_s: float, submits: int, rng: random.Random, slots: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """``n_workers`` simulated workers long-poll an empty queue: what their waiting costs the
    API for ``idle_s`` seconds, then ``submits`` jobs ``POST``ed one at a time, each at a
    random moment, and the time from each submit's start to a worker's answer carrying it
    (the woken claims race for it).

    Raises:
        RuntimeError: a submitted job was not claimed within 15 s.
    """
    conns = connections(api_url, tokens, n_workers, tag)
    claimed: list[tuple[int, float]] = []  # (job id, answered at)
    ph = Phase(serve=serve)
    stopping = asyncio.Event()

    claim = claim_body(slots)

    async def wait_for_jobs(conn: Connection) -> None:
        while not stopping.is_set():
            try:
                status, body = await conn.call("POST", CLAIM_PATH, claim)
            except (OSError, asyncio.IncompleteReadError, HttpError) as exc:
                ph.errors.append(f"transport {type(exc).__name__}: {exc}")
                await asyncio.sleep(ERROR_BACKOFF_S)
                continue
            ph.requests += 1
            if status != 200:
                ph.errors.append(f"claim {status} {body[:200]!r}")
                await asyncio.sleep(ERROR_BACKOFF_S)
                continue
            now = time.perf_counter()
            claimed.extend((int(j["job_id"]), now) for j in json.loads(body)["jobs"])

    latencies: list[float] = []
    posts: list[float] = []  # the submit's own answer time (seconds)
    try:
        await _register(conns, slots)
        tasks = [asyncio.create_task(wait_for_jobs(c)) for c in conns]
        await asyncio.sleep(2 * CLAIM_WAIT_S)  # every worker in its long poll
        cpu0, requests0 = cpu_snapshot(serve), ph.requests
        await asyncio.sleep(idle_s)
        cpu1, requests1 = cpu_snapshot(serve), ph.requests
        async with httpx.AsyncClient(base_url=api_url, timeout=30.0, trust_env=False) as http:
            for _ in range(submits):
                await asyncio.sleep(rng.uniform(0.25, 0.25 + CLAIM_WAIT_S))
                t0 = time.perf_counter()
                resp = await http.post(f"{API_PREFIX}/jobs", json=common.TINY_SPEC)
                posts.append(time.perf_counter() - t0)
                resp.raise_for_status()
                job_id = int(resp.json()["id"])
                while not (got := [t for j, t in claimed if j == job_id]):
                    if time.perf_counter() - t0 > 15.0:
                        raise RuntimeError(f"job {job_id} not claimed by {n_workers} workers")
                    await asyncio.sleep(0.002)
                latencies.append(got[0] - t0)
        stopping.set()
        await asyncio.gather(*tasks)
    finally:
        for c in conns:
            c.close()
    serve_s = common.cpu_delta(cpu0[0], cpu1[0])
    polls = requests1 - requests0
    ms = [round(1000 * v, 1) for v in latencies]
    return {
        "workers": n_workers,
        "idle_s": idle_s,
        "idle_claim_requests_per_s": round(polls / idle_s, 1),
        "idle_serve_cores_busy": round(serve_s / idle_s, 3),
        "idle_postgres_cores_busy": round(common.cpu_delta(cpu0[1], cpu1[1]) / idle_s, 3),
        "idle_serve_cpu_ms_per_claim_request": round(1000 * serve_s / polls, 2) if polls else None,
        "submit_to_claim_ms": ms,
        "submit_answer_ms": [round(1000 * v, 1) for v in posts],
        "submit_to_claim_p50_ms": percentile(ms, 50) if ms else None,
        "submit_to_claim_p90_ms": percentile(ms, 90) if ms else None,
        "duplicates": duplicates([j for j, _ in claimed]),
        "claimed": len(claimed),
        "errors": len(ph.errors),
        "first_errors": ph.errors[:3],
    }


def job_states(db: Database, ids: set[int]) -> dict[str, Any]:
    """Server-side check of the claimed jobs: rows per state and rows claimed more than once
    (attempt above 1, or more than one queued → starting event)."""
    if not ids:
        return {"states": {}, "claim_events": 0, "claimed_twice_by_events": 0, "attempt_above_1": 0}
    with db.session(write=False) as session:
        id_list = sorted(ids)
        states = {
            str(state): int(n)
            for state, n in session.execute(
                text("SELECT state, count(*) FROM jobs WHERE id = ANY(:ids) GROUP BY state"),
                {"ids": id_list},
            ).all()
        }
        per_job = (
            "SELECT job_id, count(*) AS n FROM job_events WHERE job_id = ANY(:ids) "
            "AND from_state = 'queued' AND to_state = 'starting' GROUP BY job_id"
        )
        claims, again = session.execute(
            text(f"SELECT coalesce(sum(n), 0), count(*) FILTER (WHERE n > 1) FROM ({per_job}) t"),
            {"ids": id_list},
        ).one()
        attempts = session.scalar(
            text("SELECT count(*) FROM jobs WHERE id = ANY(:ids) AND attempt > 1"),
            {"ids": id_list},
        )
    return {
        "states": states,
        "claim_events": int(claims),
        "claimed_twice_by_events": int(again),
        "attempt_above_1": int(attempts or 0),
    }


def duplicates(claimed: list[int]) -> int:
    """Claims beyond the first of each job id (a job handed out twice)."""
    return sum(n - 1 for n in Counter(claimed).values() if n > 1)
