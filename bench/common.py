"""Shared bench plumbing: sizes, interleaved repetitions, medians/p99, results, scratch DBs."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from sqlalchemy import create_engine, insert, text

from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.store import migrate
from service.store.attempts.tokens import mint_attempt_token
from service.store.db import Database
from service.store.jobs.claims import claim_next_job
from service.store.jobs.crud import Transition, apply_transition
from service.store.models import Job
from service.store.workers.registry import register_worker

SIZES = ("tiny", "default", "full")
PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class BenchResult:
    """One benchmark's figures: ``ratios`` (ours ÷ anchor, or ÷ goal) and ``goals`` (met?)."""

    name: str
    size: str
    figures: dict[str, Any] = field(default_factory=dict)
    ratios: dict[str, float | None] = field(default_factory=dict)
    goals: dict[str, bool | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "name": self.name,
            "size": self.size,
            "figures": self.figures,
            "ratios": self.ratios,
            "goals": self.goals,
            "notes": self.notes,
        }


def pick(size: str, tiny: Any, default: Any, full: Any = None) -> Any:
    """The value for ``size`` (``full`` falls back to ``default``)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, not {size!r}")
    if size == "tiny":
        return tiny
    if size == "full" and full is not None:
        return full
    return default


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    return float(statistics.median(values))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100, nearest rank) of a non-empty sequence."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
    return float(ordered[index])


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den`` rounded to 4 places, or None when either is missing or den is 0."""
    if num is None or den is None or den == 0:
        return None
    return round(num / den, 4)


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with ``--size`` and ``--json`` (write the result there)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--size", choices=SIZES, default="default")
    p.add_argument("--json", type=Path, default=None, help="write the result as JSON here")
    return p


def cli_main(run: Callable[[str], BenchResult], description: str) -> None:
    """The CLI of one benchmark module: parse ``--size``/``--json``, run, print the JSON."""
    args = parser(description).parse_args()
    text_ = json.dumps(run(args.size).as_dict(), indent=2)
    if args.json:
        args.json.write_text(text_)
    sys.stdout.write(text_ + "\n")


def interleaved_rates(
    modes: dict[str, Callable[[], Any]],
    *,
    reps: int,
    steps: int,
    before: Callable[[], None],
    finish: Callable[[str], None],
) -> dict[str, list[float]]:
    """Steps/s of each mode, ``reps`` repetitions interleaved ABAB… (a noisy machine moves
    every mode alike). Each timed segment is ``before()`` (untimed: a barrier or a device
    sync), ``steps`` calls, then ``finish(name)`` (timed: the mode's tail work, e.g. a last
    flush, and a device sync)."""
    rates: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(reps):
        for name, fn in modes.items():
            before()
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            finish(name)
            rates[name].append(steps / (time.perf_counter() - t0))
    return rates


def sqlite_url(directory: Path) -> str:
    """A SQLite database file URL under ``directory``."""
    return f"sqlite:///{directory / f'bench-{uuid.uuid4().hex[:8]}.db'}"


@contextlib.contextmanager
def pg_schema(base_url: str = PG_URL) -> Iterator[str]:
    """A URL whose search_path is a throwaway PostgreSQL schema, dropped on exit."""
    schema = f"bench_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base_url, isolation_level="AUTOCOMMIT")
    sep = "&" if "?" in base_url else "?"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        yield f"{base_url}{sep}options={quote(f'-csearch_path={schema}')}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


def migrated(url: str) -> Database:
    """A Database for ``url``, migrated to head."""
    db = Database.from_url(url)
    migrate.upgrade(db.engine)
    return db


TINY_SPEC: dict[str, Any] = {
    "name": "bench",
    "task": "regression",
    "launcher": "local",
    "resources": {"nproc_per_node": 1},
    "training": {"max_steps": 10},
}


def worker_process_env(settings: Any, base: dict[str, str]) -> dict[str, str]:
    """The environment of a ``python -m worker.main`` for ``settings``' deployment: ``base``
    and the settings without the database URL, plus a worker token minted on that database
    (a worker reaches only the API)."""
    from service.store.auth.service import create_worker_token
    from worker.up import worker_env

    db = Database.from_url(settings.resolved_database_url)
    try:
        token = create_worker_token(db, name="bench").token
    finally:
        db.dispose()
    return worker_env(settings, token, base)


def queue_jobs(db: Database, count: int, *, owner: str = "bench") -> None:
    """Bulk-insert ``count`` queued jobs (same columns as ``submit_job``, no events: fast)."""
    spec = JobSpec.model_validate(TINY_SPEC)
    row = {
        "name": spec.name,
        "owner": owner,
        "state": "queued",
        "spec": spec.model_dump(mode="json"),
        "launcher": spec.launcher,
        "gpus_per_node": spec.resources.gpus_per_node,
        "priority": spec.priority,
        "attempt": 1,
    }
    with db.session() as session:
        for start in range(0, count, 1000):
            session.execute(insert(Job), [row] * min(1000, count - start))


def add_worker(db: Database, worker_id: str) -> str:
    """Register a worker row (claims reference it); returns ``worker_id``."""
    with db.session() as session:
        register_worker(
            session, worker_id=worker_id, host="bench", pid=0, launcher="local",
            capacity={"slots": 1, "gpus": []},
        )  # fmt: skip
    return worker_id


def active_jobs(db: Database, count: int, *, owner: str = "bench") -> list[int]:
    """Queue and claim ``count`` jobs so metric writes for attempt 1 pass the fence."""
    queue_jobs(db, count, owner=owner)
    add_worker(db, "bench")
    ids = []
    for _ in range(count):
        with db.session() as session:
            job = claim_next_job(
                session, worker_id="bench", launcher="local", max_gpus_per_node=0, lease_s=3600
            )
            assert job is not None
            ids.append(job.id)
    return ids


def running_jobs(db: Database, count: int) -> dict[int, str]:
    """``count`` jobs claimed and moved to ``running``, each with one attempt token.

    Returns:
        job id → its attempt-1 token.
    """
    ids = active_jobs(db, count)
    with db.session() as session:  # one transaction: 1,000 jobs in a few seconds
        for job_id in ids:
            apply_transition(
                session, Transition(job_id, JobState.STARTING, JobState.RUNNING, "bench"),
                worker_id="bench",
            )  # fmt: skip
        return {job_id: mint_attempt_token(session, job_id, 1) for job_id in ids}


class Stopwatch:
    """``with Stopwatch() as sw: …`` then ``sw.s`` (seconds, perf_counter)."""

    def __enter__(self) -> Stopwatch:
        self._t0 = time.perf_counter()
        self.s = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.s = time.perf_counter() - self._t0


def free_port() -> int:
    """A loopback TCP port free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def serve_api(
    db_url: str,
    workdir: Path,
    *,
    workers: int = 1,
    start_timeout_s: float = 60.0,
    extra_env: dict[str, str] | None = None,
) -> Iterator[str]:
    """``ddpq serve`` for ``db_url`` in a process of its own on a free loopback port, as a
    deployment runs it (the ranks' attempt API); stopped on exit. ``extra_env``: more
    environment for it (settings such as ``DDPQ_LEASE_S``).

    Yields:
        The base URL (``http://127.0.0.1:PORT``), once ``/api/v1/healthz`` answers.
    Raises:
        RuntimeError: the server exited or did not answer within ``start_timeout_s``
            (its log, ``workdir/serve.log``, says why).
    """
    port = free_port()
    env = dict(
        os.environ,
        DDPQ_DATABASE_URL=db_url,
        DDPQ_ARTIFACT_DIR=str(workdir / "artifacts"),
        DDPQ_HOME=str(workdir / ".ddpq"),
        DDPQ_AUTH="off",
    )
    env.update(extra_env or {})
    ddpq = [sys.executable, "-c", "from service.cli.main import main; main()"]
    argv = [*ddpq, "serve", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--workers", str(workers)]
    log_path = workdir / "serve.log"
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ddpq serve exited {proc.returncode}; see {log_path}")
            try:
                httpx.get(f"{url}/api/v1/healthz", timeout=1.0)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ddpq serve not up after {start_timeout_s} s") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def attempt_token(db: Database, job_id: int, attempt: int = 1) -> str:
    """An attempt token for ``(job_id, attempt)``, minted as the worker does at launch."""
    with db.session() as session:
        return mint_attempt_token(session, job_id, attempt)


def rank_environ(
    job_id: int, api_url: str, token: str, *, rank: int = 0, world_size: int = 1
) -> dict[str, str]:
    """A rank's environment as the worker builds it (``RankEnv.from_environ`` reads it)."""
    return {
        "DDPQ_JOB_ID": str(job_id),
        "DDPQ_ATTEMPT": "1",
        "DDPQ_API_URL": api_url,
        "DDPQ_ATTEMPT_TOKEN": token,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
    }


# -- CPU seconds of processes, from /proc (Linux) ---------------------------------------------


def cpu_s(pids: Iterable[int]) -> dict[int, float]:
    """pid → user + system CPU seconds so far, of those of ``pids`` still there."""
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()  # after "(comm)": field 3 is fields[0]
            out[pid] = (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime
    return out


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two ``cpu_s`` snapshots (a pid new since: all of its)."""
    return sum(t - before.get(pid, 0.0) for pid, t in after.items())


def _procs() -> list[tuple[int, int, str, bytes]]:
    """(pid, ppid, comm, cmdline) of every process readable now."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            out.append((int(entry.name), ppid, comm, (entry / "cmdline").read_bytes()))
    return out


def serve_pids(port: int) -> list[int]:
    """The ``ddpq serve`` process listening on ``port`` and its descendants (the workers)."""
    procs = _procs()
    marker = f"--port\0{port}\0".encode()
    found = {pid for pid, _, _, cmd in procs if b"serve" in cmd and marker in cmd}
    grew = True
    while grew:  # a worker's children too (uvicorn's spawned processes)
        more = {pid for pid, ppid, _, _ in procs if ppid in found} - found
        found |= more
        grew = bool(more)
    return sorted(found)


def postgres_pids() -> list[int]:
    """Every ``postgres`` process on the box (other users' queries included)."""
    return [pid for pid, _, comm, _ in _procs() if comm == "postgres"]
