"""Helpers for the checkpoint upload tests: jobs with running attempts and their tokens, and
the rank's side of the upload protocol over any httpx-like client (TestClient or httpx)."""

from __future__ import annotations

import hashlib
from typing import Any

from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.core.wire import attempt as wire
from service.store.attempts.tokens import mint_attempt_token
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs import crud as jobs
from service.store.models import Worker
from service.store.workers import registry as workers

API = API_PREFIX


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def running_job(db: Database, owner: str = "alice", **spec: Any) -> int:
    """A job of ``owner`` claimed by worker ``w1`` and running (attempt 1); its id."""
    body = {"name": "ckpt", "task": "regression", **spec}
    with db.session() as s:
        if s.get(Worker, "w1") is None:
            workers.register_worker(
                s, worker_id="w1", host="h", pid=1, launcher="local", capacity={"slots": 64}
            )
        job, _ = jobs.submit_job(s, JobSpec.model_validate(body), owner=owner)
        job_id = job.id
    claim(db)
    move(db, job_id, JobState.STARTING, JobState.RUNNING)
    return job_id


def claim(db: Database) -> None:
    with db.session() as s:
        job = claims.claim_next_job(
            s, worker_id="w1", launcher="local", max_gpus_per_node=0, lease_s=600
        )
        assert job is not None, "a queued job to claim"


def move(db: Database, job_id: int, expected: JobState, target: JobState) -> None:
    with db.session() as s:
        jobs.apply_transition(s, jobs.Transition(job_id, expected, target, "test"))


def requeue(db: Database, job_id: int) -> None:
    """Attempt + 1, claimed and running again (a relaunch)."""
    move(db, job_id, JobState.RUNNING, JobState.QUEUED)
    claim(db)
    move(db, job_id, JobState.STARTING, JobState.RUNNING)


def mint(db: Database, job_id: int, attempt: int = 1) -> dict[str, str]:
    """Authorization headers with a fresh attempt token."""
    with db.session() as s:
        return bearer(mint_attempt_token(s, job_id, attempt))


def begin(api: Any, rank: dict[str, str], data: bytes, step: int, **kw: Any) -> Any:
    body = {"step": step, "epoch": 0, "size_bytes": len(data), "sha256": sha(data)} | kw
    return api.post(API + wire.UPLOADS_PATH, json=body, headers=rank)


def put_chunk(
    api: Any, rank: dict[str, str], upload_id: int, offset: int, body: bytes, digest: str = ""
) -> Any:
    headers = {**rank, wire.CHUNK_SHA256_HEADER: digest or sha(body)}
    headers["Content-Type"] = "application/octet-stream"
    path = API + wire.UPLOAD_CHUNK_PATH.format(upload_id=upload_id)
    return api.put(path, params={"offset": offset}, content=body, headers=headers)


def commit(api: Any, rank: dict[str, str], upload_id: int) -> Any:
    return api.post(API + wire.UPLOAD_COMMIT_PATH.format(upload_id=upload_id), headers=rank)


def status(api: Any, rank: dict[str, str], upload_id: int) -> Any:
    return api.get(API + wire.UPLOAD_PATH.format(upload_id=upload_id), headers=rank)


def send_rest(api: Any, rank: dict[str, str], upload_id: int, data: bytes, chunk: int) -> None:
    """Send ``data`` from the upload's ``received_bytes`` on, ``chunk`` bytes a request."""
    offset = status(api, rank, upload_id).json()["received_bytes"]
    while offset < len(data):
        r = put_chunk(api, rank, upload_id, offset, data[offset : offset + chunk])
        assert r.status_code == 200, r.text
        offset = r.json()["received_bytes"]


def upload(api: Any, rank: dict[str, str], data: bytes, step: int, chunk: int) -> Any:
    """A whole upload (begin, chunks, commit); the commit's response."""
    r = begin(api, rank, data, step)
    assert r.status_code in (200, 201), r.text
    send_rest(api, rank, r.json()["upload_id"], data, chunk)
    return commit(api, rank, r.json()["upload_id"])
