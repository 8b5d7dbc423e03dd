"""Why a job waits, over the real app on SQLite and PostgreSQL: its place among claimable jobs
(the claim's own order), which workers could run it and why not, other owners' jobs shown by
id and priority only, a Slurm job's pending reason in plain words, and the warning at submit
for a spec no registered worker could ever run."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.core.config import Settings
from service.core.wire import API_PREFIX
from service.store.auth.tokens import create_token
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs import crud as jobs
from service.store.jobs.notes import record_scheduler_pending
from service.store.workers import registry as workers

API = API_PREFIX
SPEC: dict[str, Any] = {
    "name": "reg",
    "task": "regression",
    "resources": {"nproc_per_node": 2},
    "training": {"max_steps": 10},
}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def auth_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"auth": "on", "slurm_enabled": True})


@pytest.fixture
def app_settings(auth_settings: Settings) -> Settings:
    """What this module's ``api`` serves (tests/conftest.py)."""
    return auth_settings


@pytest.fixture
def tokens(db: Database) -> dict[str, str]:
    with db.session() as s:
        return {
            "alice": create_token(s, owner="alice")[1],
            "bob": create_token(s, owner="bob")[1],
            "root": create_token(s, owner="root", admin=True)[1],
        }


def register(db: Database, worker_id: str, launcher: str = "local", **capacity: Any) -> None:
    with db.session() as s:
        workers.register_worker(
            s, worker_id=worker_id, host="h", pid=1, launcher=launcher, capacity=capacity
        )


def submit(api: TestClient, token: str, **changes: Any) -> dict[str, Any]:
    r = api.post(f"{API}/jobs", json={**SPEC, **changes}, headers=bearer(token))
    assert r.status_code == 201, r.text
    body: dict[str, Any] = r.json()
    return body


def queue_of(api: TestClient, token: str, job_id: int) -> dict[str, Any]:
    r = api.get(f"{API}/jobs/{job_id}", headers=bearer(token))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["queue"] is not None, f"job {job_id} ({body['state']}) should explain its wait"
    assert body["queue"]["summary"] == body["queue_reason"], "queue_reason is the summary"
    queue: dict[str, Any] = body["queue"]
    return queue


def test_a_job_waiting_for_gpus_no_worker_has(
    api: TestClient, db: Database, tokens: dict[str, str]
) -> None:
    register(db, "cpu-box", slots=2, gpus=[], cpus=2)
    register(db, "slurm-w", launcher="slurm", slots=8, gpus=[])
    gpu = {"nproc_per_node": 2, "gpus_per_node": 2}
    job = submit(api, tokens["alice"], name="gpu", resources=gpu)
    assert job["warnings"] == [
        "no registered local worker could ever run this job: it needs 2 GPUs per node, the "
        "most any has is 0"
    ], "flagged at submit, and queued all the same"
    assert job["state"] == "queued"
    queue = queue_of(api, tokens["alice"], job["id"])
    assert queue["summary"] == "waiting for a worker with 2 free GPUs (live workers have at most 0)"
    assert queue["runnable"] is False and queue["position"] == 1
    fits = {w["id"]: w for w in queue["workers"]}
    assert fits["cpu-box"]["can_ever"] is False
    assert fits["cpu-box"]["why_not"] == ["has 0 GPUs; the job needs 2 per node"]
    assert fits["slurm-w"]["why_not"] == ["runs slurm jobs, not local"]
    register(db, "gpu-box", slots=1, gpus=[0, 1])
    later = submit(api, tokens["alice"], name="gpu2", resources=gpu)
    assert later["warnings"] == [], "a registered worker has 2 GPUs now"
    queue = queue_of(api, tokens["alice"], job["id"])
    assert queue["runnable"] is True
    assert [w["id"] for w in queue["workers"] if w["can_now"]] == ["gpu-box"]


def test_a_job_behind_three_higher_priority_jobs(
    api: TestClient, db: Database, tokens: dict[str, str]
) -> None:
    register(db, "w", slots=1, gpus=[], cpus=64)
    first = submit(api, tokens["bob"], name="bob-secret-1", priority=9)["id"]
    second = submit(api, tokens["alice"], name="alice-own", priority=5)["id"]
    third = submit(api, tokens["bob"], name="bob-secret-2", priority=5)["id"]
    mine = submit(api, tokens["alice"], name="mine", priority=1)["id"]
    submit(api, tokens["bob"], name="behind", priority=1)  # lower or equal and newer: behind
    submit(api, tokens["bob"], name="cancelled", priority=20)
    with db.session() as s:
        jobs.cancel_job(s, mine + 2)  # a cancelled job is not ahead of anyone
    queue = queue_of(api, tokens["alice"], mine)
    assert queue["summary"] == "waiting for a worker to claim it (3 queued jobs ahead)"
    assert queue["position"] == 4 and queue["ahead_count"] == 3
    assert queue["ahead"] == [
        {"id": first, "priority": 9, "owner": None, "name": None},
        {"id": second, "priority": 5, "owner": "alice", "name": "alice-own"},
        {"id": third, "priority": 5, "owner": None, "name": None},
    ], "claim order; other owners' jobs by id and priority only"
    assert "bob-secret" not in str(
        api.get(f"{API}/jobs/{mine}", headers=bearer(tokens["alice"])).json()
    )
    admin = queue_of(api, tokens["root"], mine)
    assert [a["name"] for a in admin["ahead"]] == ["bob-secret-1", "alice-own", "bob-secret-2"]
    assert api.get(f"{API}/jobs/{mine}", headers=bearer(tokens["bob"])).status_code == 404
    with db.session() as s:  # the worker takes the best job: the explanation moves with it
        claimed = claims.claim_next_job(
            s, worker_id="w", launcher="local", max_gpus_per_node=0, lease_s=30
        )
        assert claimed is not None and claimed.id == first
    queue = queue_of(api, tokens["alice"], mine)
    assert queue["position"] == 3
    assert queue["summary"] == "waiting for a free slot (1 live worker, all busy)"
    assert queue["workers"][0]["why_not"] == ["all 1 slot busy"]


def test_more_ranks_than_cores_is_noted(
    api: TestClient, db: Database, tokens: dict[str, str]
) -> None:
    register(db, "small", slots=1, gpus=[], cpus=2)
    job = submit(api, tokens["alice"], resources={"nproc_per_node": 16})
    (fit,) = queue_of(api, tokens["alice"], job["id"])["workers"]
    assert fit["can_now"] is True
    assert fit["notes"][0].startswith("would run 16 ranks on 2 CPU cores")


def test_a_slurm_job_pending_in_slurm_says_why(
    api: TestClient, db: Database, tokens: dict[str, str]
) -> None:
    register(db, "slurm-w", launcher="slurm", slots=4, gpus=[])
    job_id = submit(api, tokens["alice"], launcher="slurm")["id"]
    with db.session() as s:
        claimed = claims.claim_next_job(
            s, worker_id="slurm-w", launcher="slurm", max_gpus_per_node=16, lease_s=30
        )
        assert claimed is not None
        jobs.set_scheduler_job_id(s, job_id, 1, "4242")
    body = api.get(f"{API}/jobs/{job_id}", headers=bearer(tokens["alice"])).json()
    assert body["state"] == "starting" and body["queue"] is None, "no reason recorded yet"
    with db.session() as s:
        assert record_scheduler_pending(s, job_id, 1, "Priority", "words")
        assert record_scheduler_pending(s, job_id, 1, "Resources", "words")
        assert not record_scheduler_pending(s, job_id, 1, "Resources", "words"), "no repeat"
    queue = queue_of(api, tokens["alice"], job_id)
    assert queue["scheduler"] == {
        "backend": "Slurm",
        "scheduler_job_id": "4242",
        "code": "Resources",
        "text": "waiting for the nodes, CPUs, GPUs or memory it asked for to become free",
    }
    assert queue["summary"] == (
        "Slurm job 4242 is pending: waiting for the nodes, CPUs, GPUs or memory it asked for "
        "to become free (Slurm's reason: Resources)"
    )
    events = api.get(f"{API}/jobs/{job_id}/events", headers=bearer(tokens["alice"])).json()
    reasons = [e["reason"] for e in events["events"] if e["reason"]]
    assert reasons[-2:] == [
        "scheduler pending: Priority — words",
        "scheduler pending: Resources — words",
    ]


def test_a_queued_jobs_etag_stays_through_worker_heartbeats(
    api: TestClient, db: Database, tokens: dict[str, str]
) -> None:
    from datetime import timedelta

    from sqlalchemy import update

    from service.store.models import Worker, utcnow
    from service.store.workers.leases import heartbeat

    register(db, "b-worker", slots=1, gpus=[])
    register(db, "a-worker", slots=1, gpus=[])
    register(db, "gone", slots=1, gpus=[])
    with db.session() as s:
        old = utcnow() - timedelta(hours=1)
        s.execute(update(Worker).where(Worker.id == "gone").values(heartbeat_at=old))
    job = submit(api, tokens["alice"])
    url, alice = f"{API}/jobs/{job['id']}", bearer(tokens["alice"])
    first = api.get(url, headers=alice)
    etag = first.headers["etag"]
    fits = {w["id"]: w for w in first.json()["queue"]["workers"]}
    assert fits["a-worker"]["live"] and fits["a-worker"]["heartbeat_at"] is None
    assert not fits["gone"]["live"] and fits["gone"]["heartbeat_at"] is not None
    assert fits["gone"]["why_not"][0].startswith("silent: no heartbeat since")
    assert [w["id"] for w in first.json()["queue"]["workers"]] == ["a-worker", "b-worker", "gone"]
    for worker_id in ("b-worker", "a-worker", "b-worker"):  # beats in turn: nothing changed
        with db.session() as s:
            heartbeat(s, worker_id, lease_s=30.0)
        again = api.get(url, headers={**alice, "If-None-Match": etag})
        assert again.status_code == 304, again.text
    with db.session() as s:
        workers.stop_worker(s, "b-worker")  # something did change: a new ETag
    assert api.get(url, headers={**alice, "If-None-Match": etag}).status_code == 200
