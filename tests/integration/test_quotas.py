"""Quotas through the real app, on SQLite and PostgreSQL, with auth on and two owners: owner
B hits each quota (checkpoint bytes per job and per owner, workspace bytes, uploads in
flight, metric names, metric points per minute) and gets the refusal naming the setting and
a ``quota_exceeded`` event on the job; owner A's uploads and points in the same moment are
unaffected, and nothing already stored is lost. Small quotas in the settings, small bytes."""

from __future__ import annotations

import os
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from service.core.config import Settings
from service.core.wire import attempt as wire
from service.store.db import Database
from service.store.models import Job, JobEvent
from tests import workspaces
from tests.uploads import API, begin, commit, mint, running_job, send_rest, upload

CHUNK = 64 * 1024  # the smallest chunk cap the settings allow
CKPT = 10_000  # bytes of one checkpoint in these tests
JOB_MAX = 3 * CKPT + 500  # three checkpoints fit a job, not four
OWNER_MAX = 5 * CKPT + 500  # five fit an owner
NAMES = 5
PER_MINUTE = 50


@pytest.fixture
def app_settings(settings: Settings) -> Settings:
    """What this module's ``api`` serves (tests/conftest.py)."""
    return settings.model_copy(
        update={
            "auth": "on",
            "checkpoint_chunk_bytes": CHUNK,
            "checkpoint_job_max_bytes": JOB_MAX,
            "checkpoint_owner_max_bytes": OWNER_MAX,
            "workspace_owner_max_bytes": 3 * CKPT,
            "uploads_in_flight_per_owner": 3,
            "metric_names_per_job": NAMES,
            "metric_points_per_minute": PER_MINUTE,
        }
    )


def quota_events(db: Database, job_id: int) -> list[dict[str, Any]]:
    with db.session(write=False) as s:
        rows = s.scalars(
            select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == "quota_exceeded")
        )
        return [dict(e.data) | {"reason": e.reason} for e in rows]


def failed_saves(db: Database, job_id: int) -> list[str]:
    with db.session(write=False) as s:
        rows = s.scalars(
            select(JobEvent.reason).where(
                JobEvent.job_id == job_id, JobEvent.kind == "checkpoint_failed"
            )
        )
        return [r or "" for r in rows]


def steps(api: TestClient, user: dict[str, str], job_id: int) -> list[int]:
    r = api.get(f"{API}/jobs/{job_id}/checkpoints", headers=user)
    assert r.status_code == 200, r.text
    return sorted(c["step"] for c in r.json()["checkpoints"])


def test_checkpoint_bytes_per_job_and_owner_refuse_a_save_before_its_bytes(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    a_job = running_job(db, "alice", training={"keep_checkpoints": 5})
    b1 = running_job(db, "bob", training={"keep_checkpoints": 5})
    b2 = running_job(db, "bob", training={"keep_checkpoints": 5})
    alice, bob1, bob2 = mint(db, a_job), mint(db, b1), mint(db, b2)
    for step in (1, 2, 3):
        assert upload(api, bob1, os.urandom(CKPT), step, CHUNK).status_code == 201

    # The fourth would pass the job's quota: refused at its start, nothing received.
    r = begin(api, bob1, os.urandom(CKPT), 4)
    assert r.status_code == 413, r.text
    assert r.json()["code"] == "quota_exceeded"
    assert "DDPQ_CHECKPOINT_JOB_MAX_BYTES" in r.json()["detail"]
    assert steps(api, users["bob"], b1) == [1, 2, 3], "nothing deleted to make room"
    assert any("DDPQ_CHECKPOINT_JOB_MAX_BYTES" in f for f in failed_saves(db, b1))
    (hit,) = quota_events(db, b1)
    assert hit["quota"] == "checkpoint bytes per job" and hit["limit"] == JOB_MAX
    assert hit["asked"] == 4 * CKPT and hit["setting"] == "DDPQ_CHECKPOINT_JOB_MAX_BYTES"

    # Bob's second job has room of its own, but his jobs together reach the owner's quota.
    assert upload(api, bob2, os.urandom(CKPT), 1, CHUNK).status_code == 201
    r = begin(api, bob2, os.urandom(CKPT), 2)  # under way: its size is reserved
    assert r.status_code == 201, r.text
    r = begin(api, bob2, os.urandom(2 * CKPT), 3)  # supersedes step 2's upload, still over
    assert r.status_code == 413 and "DDPQ_CHECKPOINT_OWNER_MAX_BYTES" in r.json()["detail"]
    assert [e["quota"] for e in quota_events(db, b2)] == ["checkpoint bytes per owner"]

    # Alice, meanwhile, is untouched: her uploads go through, her list is whole.
    for step in (1, 2, 3):
        assert upload(api, alice, os.urandom(CKPT), step, CHUNK).status_code == 201
    assert steps(api, users["alice"], a_job) == [1, 2, 3]
    assert quota_events(db, a_job) == []


def test_retention_frees_quota_and_a_repeated_hit_is_one_event(
    api: TestClient, db: Database
) -> None:
    job_id = running_job(db, "bob", training={"keep_checkpoints": 2})
    rank = mint(db, job_id)
    # keep_checkpoints=2: each commit lets the oldest go, so three live ones never coexist
    # and a job quota of three checkpoints (plus the one on its way) holds forever.
    for step in range(1, 6):
        assert upload(api, rank, os.urandom(CKPT), step, CHUNK).status_code == 201
    for step in (6, 7):  # two live + one twice as big: over
        r = begin(api, rank, os.urandom(2 * CKPT), step)
        assert r.status_code == 413, r.text
    assert len(quota_events(db, job_id)) == 1, "one event per attempt and quota"
    assert len([f for f in failed_saves(db, job_id) if "quota" in f]) == 2, "each a failed save"


def test_uploads_in_flight_per_owner_is_429_with_retry_after(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    bob_jobs = [running_job(db, "bob") for _ in range(3)]
    alice_job = running_job(db, "alice")
    ranks = [mint(db, j) for j in bob_jobs]
    data = [os.urandom(1000) for _ in bob_jobs]
    for rank, d in zip(ranks[:2], data, strict=False):
        assert begin(api, rank, d, 1).status_code == 201
    assert workspaces.begin(api, users["bob"], os.urandom(100)).status_code == 201
    r = begin(api, ranks[2], data[2], 1)
    assert r.status_code == 429, r.text
    assert int(r.headers["Retry-After"]) >= 1
    assert "DDPQ_UPLOADS_IN_FLIGHT_PER_OWNER" in r.json()["detail"]
    assert [e["quota"] for e in quota_events(db, bob_jobs[2])] == ["uploads in flight per owner"]
    assert failed_saves(db, bob_jobs[2]) == [], "a 429 is retried, not a failed save"
    r = workspaces.begin(api, users["bob"], os.urandom(200))
    assert r.status_code == 429 and "DDPQ_UPLOADS_IN_FLIGHT_PER_OWNER" in r.json()["detail"]

    # Alice's are her own count.
    assert upload(api, mint(db, alice_job), os.urandom(1000), 1, CHUNK).status_code == 201
    # One of Bob's finishing makes room.
    first = begin(api, ranks[0], data[0], 1).json()["upload_id"]
    send_rest(api, ranks[0], first, data[0], CHUNK)
    assert commit(api, ranks[0], first).status_code == 201
    assert begin(api, ranks[2], data[2], 1).status_code == 201


def test_workspace_bytes_per_owner_count_files_and_uploads_under_way(
    api: TestClient, users: dict[str, dict[str, str]]
) -> None:
    alice, bob = users["alice"], users["bob"]
    kept = os.urandom(2 * CKPT)
    workspaces.upload(api, bob, kept)
    pending = workspaces.begin(api, bob, os.urandom(CKPT // 2))
    assert pending.status_code == 201  # 2.5 of 3 units: its size is reserved now
    r = workspaces.begin(api, bob, os.urandom(CKPT))
    assert r.status_code == 413, r.text
    assert r.json()["code"] == "quota_exceeded"
    assert "DDPQ_WORKSPACE_OWNER_MAX_BYTES" in r.json()["detail"]
    again = workspaces.begin(api, bob, kept)  # a file Bob has costs nothing more
    assert again.status_code == 200 and again.json()["state"] == "committed"
    workspaces.upload(api, alice, os.urandom(2 * CKPT))  # Alice's quota is hers


def test_metric_names_per_job_refuse_the_whole_batch_once_noted(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    a_job, b_job = running_job(db, "alice"), running_job(db, "bob")
    alice, bob = mint(db, a_job), mint(db, b_job)
    first = {"points": [[f"m{i}", 1, 0, 1.0, 1.7e9] for i in range(NAMES - 1)]}
    assert api.post(API + wire.METRICS_PATH, json=first, headers=bob).status_code == 200
    two_new = {"points": [["m0", 2, 0, 2.0, 1.7e9], ["x1", 2, 0, 1.0, 1.7e9],
                          ["x2", 2, 0, 1.0, 1.7e9]]}  # fmt: skip
    for _ in range(2):
        r = api.post(API + wire.METRICS_PATH, json=two_new, headers=bob)
        assert r.status_code == 422, r.text
        assert r.json()["code"] == "quota_exceeded"
        assert "DDPQ_METRIC_NAMES_PER_JOB" in r.json()["detail"]
        # Which of the batch's names the job has: what the rank may send again.
        assert r.json()["stored_names"] == ["m0"]
    (hit,) = quota_events(db, b_job)
    assert (hit["quota"], hit["limit"], hit["asked"]) == ("metric names per job", NAMES, NAMES + 1)
    # Nothing of the refused batch is stored (not even m0's point of a known name).
    m0 = api.get(f"{API}/jobs/{b_job}/metrics", params={"name": "m0"}, headers=users["bob"])
    assert [p["step"] for p in m0.json()["points"]] == [1]
    one_new = {"points": [["m0", 2, 0, 2.0, 1.7e9], ["x1", 2, 0, 1.0, 1.7e9]]}
    assert api.post(API + wire.METRICS_PATH, json=one_new, headers=bob).status_code == 200
    known = {"points": [["x1", 3, 0, 1.0, 1.7e9]], "progress": {"step": 3}}
    assert api.post(API + wire.METRICS_PATH, json=known, headers=bob).status_code == 200

    many = {"points": [[f"a{i}", 1, 0, 1.0, 1.7e9] for i in range(NAMES)]}
    r = api.post(API + wire.METRICS_PATH, json=many, headers=alice)
    assert r.status_code == 200 and r.json()["inserted"] == NAMES


def test_metric_points_per_minute_is_429_and_counts_stored_points(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    a_job, b_job = running_job(db, "alice"), running_job(db, "bob")
    alice, bob = mint(db, a_job), mint(db, b_job)

    def batch(first: int, n: int) -> dict[str, Any]:
        return {"points": [["loss", s, 0, float(s), 1.7e9] for s in range(first, first + n)]}

    assert api.post(API + wire.METRICS_PATH, json=batch(1, 40), headers=bob).status_code == 200
    resent = api.post(API + wire.METRICS_PATH, json=batch(1, 5), headers=bob)
    assert resent.json()["inserted"] == 0  # duplicates are free: 40 stored this minute
    r = api.post(API + wire.METRICS_PATH, json=batch(41, 20), headers=bob)
    assert r.status_code == 429, r.text
    assert 1 <= int(r.headers["Retry-After"]) <= 60
    assert "DDPQ_METRIC_POINTS_PER_MINUTE" in r.json()["detail"]
    r = api.post(API + wire.METRICS_PATH, json=batch(41, PER_MINUTE + 1), headers=bob)
    assert r.status_code == 422, "a batch bigger than the rate never fits"
    assert [e["quota"] for e in quota_events(db, b_job)] == ["metric points per job per minute"]
    assert api.post(API + wire.METRICS_PATH, json=batch(1, 50), headers=alice).status_code == 200

    with db.session() as s:  # the minute passes
        job = s.get_one(Job, b_job)
        assert job.metric_window_at is not None and job.metric_window_points == 40
        job.metric_window_at = job.metric_window_at.replace(year=2000)
    r = api.post(API + wire.METRICS_PATH, json=batch(41, 20), headers=bob)
    assert r.status_code == 200 and r.json()["inserted"] == 20
    got = api.get(f"{API}/jobs/{b_job}/metrics", params={"name": "loss"}, headers=users["bob"])
    assert [p["step"] for p in got.json()["points"]] == list(range(1, 61)), "each point once"
