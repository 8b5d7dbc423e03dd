"""End-to-end fixtures: a real API server and real workers as subprocesses, real torchrun ranks.

``deployment`` gives one deployment (SQLite by default; request ``pg_deployment`` for
PostgreSQL) with its own database, artifact dir and API port. Workers tick fast
(heartbeat 0.3 s). Everything it started is stopped at teardown, and no rank process of the
deployment may be left (found by ``DDPQ_ARTIFACT_DIR`` in ``/proc/*/environ``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from service.core.config import Settings
from service.core.wire import API_PREFIX
from service.store import migrate
from service.store.db import Database
from tests.e2e.hosts import RootHub
from tests.e2e.jobs_http import JobsOverHttp, Proc, wait_for
from tests.workers import mint_worker_token, worker_environ
from worker.processes import find_tagged_processes
from worker.up import settings_env

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tagged_processes(artifact_dir: Path, job_id: int | None = None) -> list[int]:
    """Pids whose environment carries this deployment's artifact dir (and ``job_id``)."""
    needles = {f"DDPQ_ARTIFACT_DIR={artifact_dir}".encode()}
    if job_id is not None:
        needles.add(f"DDPQ_JOB_ID={job_id}".encode())
    return find_tagged_processes(frozenset(needles))


def load_example(name: str, **overrides: Any) -> dict[str, Any]:
    """``examples/<name>.yaml`` with top-level sections updated from ``overrides``."""
    spec: dict[str, Any] = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


class Deployment(JobsOverHttp):
    """One API server plus any number of workers on one database.

    Test modules cannot import this conftest (importlib mode), so the helpers they need are
    reachable from the fixture: ``dep.wait_for``, ``dep.load_example``, ``dep.processes``.
    """

    wait_for = staticmethod(wait_for)
    load_example = staticmethod(load_example)

    def __init__(self, settings: Settings, tmp_path: Path) -> None:
        self.settings = settings
        self.tmp_path = tmp_path
        self.artifact_dir = settings.resolved_artifact_dir
        self.db = Database.from_url(settings.resolved_database_url)
        migrate.upgrade(self.db.engine)
        self.env = {**os.environ, **settings_env(settings), "PYTHONUNBUFFERED": "1"}
        self.procs: list[Proc] = []
        self.api = self._spawn(
            "api",
            [sys.executable, "-m", "uvicorn", "--factory", "service.app:create_app",
             "--host", "127.0.0.1", "--port", str(settings.port), "--no-access-log"],
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{settings.port}"
        self.http = httpx.Client(base_url=self.url + API_PREFIX, timeout=30)
        wait_for(self._ready, 90, "the API to answer /readyz")

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        log_path = self.tmp_path / f"{name}-{len(self.procs)}.log"
        proc = Proc(name, argv, self.env if env is None else env, log_path)
        self.procs.append(proc)
        return proc

    def _ready(self) -> bool:
        if self.api.popen.poll() is not None:
            raise AssertionError(f"the API exited:\n{self.api.output()}")
        try:
            return httpx.get(self.url + "/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def processes(self, job_id: int) -> list[int]:
        """Live processes of ``job_id`` (torchrun and its ranks) in this deployment."""
        return tagged_processes(self.artifact_dir, job_id)

    def worker_env(self) -> dict[str, str]:
        """A worker's environment here: the API's URL and a worker token, no database URL."""
        if not getattr(self, "_worker_token", None):
            self._worker_token = mint_worker_token(self.db)
        return worker_environ(self.settings, self._worker_token, self.env)

    def start_worker(self, slots: int = 1) -> Proc:
        """A worker subprocess (``python -m worker.main``), local launcher, no GPUs; it
        reaches only the API, with a worker token."""
        argv = [sys.executable, "-m", "worker.main", "--slots", str(slots), "--gpus", "none"]
        return self._spawn("worker", argv, self.worker_env())

    def diagnostics(self, job_id: int) -> str:
        """Worker output and the job's rank logs, for failure messages."""
        parts = [f"--- {p.name} ({p.log_path.name})\n{p.output()}" for p in self.procs]
        for log in sorted((self.artifact_dir / "jobs" / str(job_id)).glob("attempt-*/*.log")):
            parts.append(f"--- {log}\n{log.read_text(errors='replace')[-4000:]}")
        return "\n".join(parts)

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.http.close()
        self.db.dispose()


def _settings(tmp_path: Path, database_url: str, lease_s: float = 15) -> Settings:
    return Settings(
        home=tmp_path / ".ddpq",
        database_url=database_url,
        artifact_dir=tmp_path / "artifacts",
        port=free_port(),
        heartbeat_interval_s=0.3,
        lease_s=lease_s,
        allowed_entrypoints=["examples.*:*", "tests.e2e.deaf_loop:*"],
    )


def _lease_s(request: pytest.FixtureRequest) -> float:
    """The lease of the test's deployment: its ``lease`` mark's, else 15 s (a lost worker's
    job comes back soon; a worker cut off from the API stops its ranks ~7 s after its last
    heartbeat got through)."""
    mark = request.node.get_closest_marker("lease")
    return float(mark.args[0]) if mark is not None else 15.0


def _deployment(tmp_path: Path, database_url: str, lease_s: float = 15) -> Iterator[Deployment]:
    dep = Deployment(_settings(tmp_path, database_url, lease_s), tmp_path)
    try:
        yield dep
    finally:
        dep.close()
    wait_for(lambda: not tagged_processes(dep.artifact_dir), 30, "no process of it to be left")


@pytest.fixture
def deployment(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Deployment]:
    """A deployment on SQLite."""
    yield from _deployment(tmp_path, f"sqlite:///{tmp_path / 'ddpq.db'}", _lease_s(request))


@pytest.fixture
def pg_deployment(
    tmp_path: Path, pg_schema_url: str, request: pytest.FixtureRequest
) -> Iterator[Deployment]:
    """A deployment on a fresh PostgreSQL schema."""
    yield from _deployment(tmp_path, pg_schema_url, _lease_s(request))


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A 0755 directory another Unix user (DDPQ_RANK_USER's ranks) can traverse: pytest's
    ``tmp_path`` is 0700 and owned by root."""
    path = Path(tempfile.mkdtemp(prefix="ddpq-shared-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def root_hub() -> Iterator[RootHub]:
    """Worker namespaces around the root's (``hosts.RootHub``), deleted afterwards; skips,
    saying why, where namespaces cannot be made."""
    hub = RootHub()
    try:
        hub.create_hub()
    except (OSError, subprocess.SubprocessError) as exc:
        hub.destroy()
        pytest.skip(f"network namespaces cannot be made here ({exc}; needs root and `ip netns`)")
    try:
        yield hub
    finally:
        hub.destroy()
