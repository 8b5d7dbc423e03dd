"""Fixtures for the fuzz tests: the app served by a real uvicorn on a loopback port, over the
``db_url`` database (SQLite and PostgreSQL), seeded with real jobs, metrics, checkpoints and
logs so that generated path parameters also hit existing rows and files.

The server runs as in production: auth on (an admin token in ``Served.headers``), so a request
without the token must get 401; the submission rate limit is lifted so that hundreds of
generated submissions are stored rather than refused with 429.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from service.app import create_app
from service.core import artifacts
from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.store.auth.tokens import create_token
from service.store.checkpoints.crud import record_checkpoint
from service.store.db import Database
from service.store.jobs.claims import claim_next_job
from service.store.jobs.crud import Transition, apply_transition, submit_job
from service.store.metrics.points import MetricPoint, record_metrics
from service.store.workers.registry import register_worker
from tests.live import serve_app

API = API_PREFIX


@dataclass(frozen=True)
class Served:
    """A running app: its base URL (``http://127.0.0.1:<port>``), settings and database, and
    the seeded rows: ``job_ids`` (running with metrics, checkpoints and logs; then queued),
    ``steps`` (checkpoint steps of the first job)."""

    url: str
    settings: Settings
    db: Database
    job_ids: tuple[int, ...]
    steps: tuple[int, ...]
    token: str

    @property
    def headers(self) -> dict[str, str]:
        """The admin's ``Authorization`` header, and ``Connection: close``: on a kept-alive
        connection each answer from uvicorn's h11 waited ~45 ms (Nagle vs delayed ACK); a
        fresh loopback connection per request costs ~5 ms."""
        return {"Authorization": f"Bearer {self.token}", "Connection": "close"}

    def client(self) -> httpx.Client:
        """An HTTP client for ``/api/v1`` of this server, as the admin."""
        return httpx.Client(base_url=f"{self.url}{API}", headers=self.headers, timeout=30)


def seed(db: Database, settings: Settings) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A running 2-rank job with metrics (NaN and ±inf among them), two checkpoint files and
    both ranks' logs, plus a queued job. Returns ``(job_ids, checkpoint_steps)``."""
    root = settings.resolved_artifact_dir
    with db.session() as s:
        running, _ = submit_job(
            s,
            JobSpec.model_validate(
                {"name": "seeded", "task": "regression", "resources": {"nproc_per_node": 2}}
            ),
            owner=settings.default_owner,
        )
        register_worker(s, worker_id="w1", host="h", pid=1, launcher="local", capacity={})
    with db.session() as s:
        claimed = claim_next_job(
            s, worker_id="w1", launcher="local", max_gpus_per_node=0, lease_s=3600
        )
        assert claimed is not None and claimed.id == running.id
        apply_transition(s, Transition(running.id, JobState.STARTING, JobState.RUNNING))
    values = [1.0 / (i + 1) for i in range(50)] + [float("nan"), float("inf"), -float("inf")]
    points = [MetricPoint(name="loss", step=i + 1, value=v, epoch=0) for i, v in enumerate(values)]
    points.append(MetricPoint(name="acc", step=1, value=0.5, epoch=0))
    progress = {"step": 53, "total_steps": 100, "epoch": 0, "samples_per_s": 10.0, "eta_s": 4.0}
    steps = (10, 20)
    with db.session() as s:
        record_metrics(s, running.id, 1, points, progress=progress)
        for step in steps:
            payload = f"checkpoint {step}".encode()
            path = artifacts.checkpoint_path(root, running.id, step)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(payload)
            record_checkpoint(
                s, running.id, 1, step=step, epoch=0, path=str(path),
                size_bytes=len(payload), sha256=hashlib.sha256(payload).hexdigest(),
            )  # fmt: skip
    for rank in (0, 1):
        log = artifacts.rank_log_path(root, running.id, 1, rank)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("".join(f"rank {rank} step {i} ✓\n" for i in range(100)))
    with db.session() as s:
        queued, _ = submit_job(
            s, JobSpec.model_validate({"name": "queued", "task": "digits"}),
            owner=settings.default_owner,
        )  # fmt: skip
    return (running.id, queued.id), steps


@pytest.fixture
def served(settings: Settings, db: Database) -> Iterator[Served]:
    """The seeded app with auth on, served over loopback for one test."""
    settings = settings.model_copy(update={"auth": "on", "submissions_per_minute": 10**9})
    job_ids, steps = seed(db, settings)
    with db.session() as session:
        _, token = create_token(session, owner="fuzz-admin", admin=True)
    with serve_app(create_app(settings)) as url:
        yield Served(url=url, settings=settings, db=db, job_ids=job_ids, steps=steps, token=token)
