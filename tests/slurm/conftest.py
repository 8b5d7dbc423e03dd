"""Fixtures for tests against the real dev Slurm cluster (``scripts/slurm-dev-cluster.sh up``).

They run when ``DDPQ_TEST_SLURM=1`` (CI sets it after bringing the cluster up) and are skipped
otherwise; with the variable set, a cluster that does not answer fails the tests loudly.
Every wait has a timeout: nothing here can hang.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from service.core.config import Settings
from service.core.spec.model import validate_spec
from service.store import migrate
from service.store.db import Database
from service.store.jobs import crud as jobs
from service.store.models import Job, Metric
from tests.workers import mint_worker_token, worker_settings

ENABLED = os.environ.get("DDPQ_TEST_SLURM") == "1"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Skip this directory's tests unless DDPQ_TEST_SLURM=1."""
    if ENABLED:
        return
    skip = pytest.mark.skip(reason="needs the dev Slurm cluster: set DDPQ_TEST_SLURM=1")
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def slurm_cluster() -> None:
    """Fail (not skip) when the tests are enabled but the cluster does not answer."""
    if not ENABLED:
        return
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %T"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.fail(f"Slurm does not answer ({exc}); run scripts/slurm-dev-cluster.sh up")
    if "idle" not in out and "mixed" not in out:
        pytest.fail(f"no usable Slurm node:\n{out}\nrun scripts/slurm-dev-cluster.sh up")


def slurm_settings(tmp_path: Path, database_url: str | None = None) -> Settings:
    """Settings for one test: its own database and artifact dir, Slurm on, fast heartbeats."""
    return Settings(
        home=tmp_path / ".ddpq",
        database_url=database_url or f"sqlite:///{tmp_path}/ddpq.db",
        artifact_dir=tmp_path / "artifacts",
        slurm_enabled=True,
        heartbeat_interval_s=0.5,
        lease_s=30.0,
    )


SlurmDb = tuple[Settings, Database]


@pytest.fixture
def slurm_db(tmp_path: Path) -> Iterator[SlurmDb]:
    """SQLite-backed settings, a migrated database, and an API on it that the Slurm ranks
    report to (they hold no database URL): ``settings.api_url`` is its URL. The dev
    cluster's nodes are this host's slurmd processes (NodeAddr 127.0.0.1), so a loopback
    server reaches them."""
    settings = slurm_settings(tmp_path)
    db = Database.from_url(settings.resolved_database_url)
    migrate.upgrade(db.engine)
    with serving_api(settings) as served:
        yield served, db
    db.dispose()


@contextmanager
def serving_api(settings: Settings) -> Iterator[Settings]:
    """An API on ``settings``' database for the block; yields ``settings`` with its URL as
    ``api_url`` (what the worker hands its Slurm ranks)."""
    from service.app import create_app
    from tests.live import serve_app

    with serve_app(create_app(settings)) as url:
        yield settings.model_copy(update={"api_url": url})


def assert_no_database_url(settings: Settings, job_id: int) -> None:
    """No file of the job's submitit folders (pickles, scripts, task logs) holds the database
    URL, and every folder is owner-only (0700)."""
    url = settings.resolved_database_url.encode()
    job_dir = settings.resolved_artifact_dir / "jobs" / str(job_id)
    folders = sorted(job_dir.glob("attempt-*/slurm"))
    assert folders, f"no submitit folder under {job_dir}"
    for folder in folders:
        assert folder.stat().st_mode & 0o777 == 0o700, f"{folder} should be mode 0700"
        for path in folder.rglob("*"):
            if path.is_file():
                assert url not in path.read_bytes(), f"{path} holds the database URL"


def submit(db: Database, settings: Settings, data: dict[str, Any]) -> int:
    """Validate and queue a spec (``launcher: slurm`` added); returns the job id."""
    spec = validate_spec({"name": "slurm-test", "launcher": "slurm", **data}, settings)
    with db.session() as s:
        job, _ = jobs.submit_job(s, spec, owner="test")
        return job.id


def job_row(db: Database, job_id: int) -> Job:
    """A fresh copy of the job's row."""
    with db.session(write=False) as s:
        job = s.get(Job, job_id)
        assert job is not None
        s.expunge(job)
        return job


def loss_steps(db: Database, job_id: int) -> list[int]:
    """The steps that have a ``loss`` point, ascending."""
    with db.session(write=False) as s:
        return list(
            s.scalars(
                select(Metric.step)
                .where(Metric.job_id == job_id, Metric.name == "loss")
                .order_by(Metric.step)
            )
        )


def count_losses(db: Database, job_id: int) -> int:
    """How many ``loss`` points the job has."""
    with db.session(write=False) as s:
        return int(
            s.scalar(
                select(func.count())
                .select_from(Metric)
                .where(Metric.job_id == job_id, Metric.name == "loss")
            )
            or 0
        )


def sacct_state(scheduler_job_id: str) -> str:
    """The newest sacct State of a Slurm job ("" while sacct does not list it)."""
    out = subprocess.run(
        ["sacct", "-n", "-P", "-X", "-o", "State", "-j", scheduler_job_id],
        capture_output=True,
        text=True,
        timeout=20,
    ).stdout
    lines = [ln for ln in out.splitlines() if ln.strip()]
    return lines[-1].split(" ")[0] if lines else ""


@contextmanager
def running_worker(
    settings: Settings, timeout_s: float = 30.0, *, slots: int = 1
) -> Iterator[threading.Event]:
    """``run_worker(settings, launcher="slurm", slots=slots)`` in a thread, with a worker
    token minted on ``settings``' database and no database URL (it reaches the API at
    ``settings.resolved_api_url``); stopped (and joined) on exit."""
    from worker.main import run_worker

    settings = worker_settings(settings, mint_worker_token(settings.resolved_database_url))
    stop = threading.Event()
    errors: list[BaseException] = []

    def _run() -> None:
        try:
            run_worker(settings, launcher="slurm", stop=stop, slots=slots)
        except BaseException as exc:  # surfaced in the test below
            errors.append(exc)

    thread = threading.Thread(target=_run, name="slurm-worker", daemon=True)
    try:
        thread.start()
        yield stop
    finally:
        stop.set()
        thread.join(timeout_s)
    assert not thread.is_alive(), f"worker did not stop within {timeout_s} s"
    assert not errors, f"worker raised: {errors[0]!r}"
