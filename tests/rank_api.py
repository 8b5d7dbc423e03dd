"""The attempt API as rank-side tests meet it: the real app under uvicorn on a fixed loopback
port that a test can stop and start again (an API outage), a running job, and its token.

Rank code reports only through the attempt API; these helpers give a test the real server and
database behind it, so the assertions read the stored rows while the rank side is exercised
over real HTTP.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from sqlalchemy import select

from service.app import create_app
from service.core import artifacts
from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.store.attempts.tokens import mint_attempt_token
from service.store.db import Database
from service.store.jobs.claims import claim_next_job
from service.store.jobs.crud import Transition, apply_transition, submit_job
from service.store.models import Job
from service.store.workers.registry import register_worker
from worker import attempt as contract
from worker.runtime.attempt_client import AttemptClient


class LiveApi:
    """``create_app(settings)`` served on one loopback port; ``stop`` then ``start`` serve it
    again on the same port (what a rank sees when ``ddpq serve`` restarts).

    Raises (``start``):
        RuntimeError: the server did not start within 30 s.
    """

    def __init__(self, settings: Settings, port: int = 0) -> None:
        self.settings = settings
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    def start(self) -> None:
        """Serve (a fresh app and server, the same port)."""
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        app = create_app(self.settings)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                sock.close()
                raise RuntimeError("uvicorn did not start within 30 s (see the log above)")
            time.sleep(0.02)
        self._server, self._thread, self._sock = server, thread, sock

    def stop(self) -> None:
        """Stop serving: new connections are refused until ``start``. Idempotent."""
        if self._server is None:
            return
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(15)
        if self._sock is not None:
            self._sock.close()
        self._server = self._thread = self._sock = None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def live_api(settings: Settings) -> Iterator[LiveApi]:
    """A started ``LiveApi`` for ``settings`` until the block ends."""
    api = LiveApi(settings)
    api.start()
    try:
        yield api
    finally:
        api.stop()


def running_job(db: Database, spec: JobSpec | None = None) -> tuple[int, int]:
    """A job claimed by a worker and marked running: ``(job_id, attempt)``."""
    with db.session() as s:
        register_worker(s, worker_id="w1", host="h", pid=1, launcher="local", capacity={"slots": 1})
        submit_job(s, spec or JobSpec(name="t", task="regression"), owner="o")
    with db.session() as s:
        job = claim_next_job(s, worker_id="w1", launcher="local", max_gpus_per_node=0, lease_s=600)
        assert job is not None
        job_id, attempt = job.id, job.attempt
    with db.session() as s:
        apply_transition(s, Transition(job_id, JobState.STARTING, JobState.RUNNING))
    return job_id, attempt


def mint_token(db: Database, job_id: int, attempt: int) -> str:
    """A fresh attempt token for ``(job_id, attempt)``, as the worker mints one at launch."""
    with db.session() as s:
        return mint_attempt_token(s, job_id, attempt)


def prepare_attempt(settings: Settings, job_id: int, attempt: int) -> str:
    """What the worker does before it starts the ranks: write the job's spec file into the
    attempt directory and mint the attempt's token (returned)."""
    db = Database.from_url(settings.resolved_database_url)
    try:
        with db.session(write=False) as s:
            spec = JobSpec.model_validate(s.scalar(select(Job.spec).where(Job.id == job_id)))
        token = mint_token(db, job_id, attempt)
    finally:
        db.dispose()
    path = artifacts.spec_path(settings.resolved_artifact_dir, job_id, attempt)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(spec.model_dump_json())
    return token


def attempt_client(
    db: Database, api_url: str, job_id: int, attempt: int, **kw: Any
) -> AttemptClient:
    """A rank's client for the attempt, with a freshly minted token."""
    return AttemptClient(api_url, mint_token(db, job_id, attempt), **kw)


def rank_environ(api_url: str, token: str, job_id: int, attempt: int) -> dict[str, str]:
    """The ddpq entries a rank needs besides the topology: identity, API URL and token."""
    return {
        contract.JOB_ID: str(job_id),
        contract.ATTEMPT: str(attempt),
        contract.API_URL: api_url,
        contract.ATTEMPT_TOKEN: token,
    }
