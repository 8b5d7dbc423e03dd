"""Retention owned by the database, on SQLite and PostgreSQL: the newest keep_checkpoints
stay, the checkpoint an attempt resumed from stays until a newer one is committed, one a
running job's init_from names stays pinned, each deletion is an event and removes the file;
orphaned partial uploads are cleaned by the API's reaper."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from service.api.files import checkpoint_stores
from service.app import create_app
from service.core import artifacts
from service.core.config import Settings
from service.core.states import JobState
from service.core.wire import attempt as wire
from service.store.checkpoints.backends.base import UploadKey
from service.store.db import Database
from service.store.models import Checkpoint, CheckpointChunk, CheckpointUpload, utcnow
from service.store.reaper import reap_uploads
from tests.uploads import (
    API,
    begin,
    commit,
    mint,
    move,
    put_chunk,
    requeue,
    running_job,
    send_rest,
    sha,
    upload,
)

CHUNK = 64 * 1024


@pytest.fixture(params=["filesystem", "database"])
def store_settings(request: pytest.FixtureRequest, settings: Settings) -> Settings:
    return settings.model_copy(
        update={"checkpoint_store": request.param, "checkpoint_chunk_bytes": CHUNK}
    )


@pytest.fixture
def app_settings(store_settings: Settings) -> Settings:
    """What this module's ``api`` serves (tests/conftest.py)."""
    return store_settings


def steps(api: TestClient, job_id: int) -> list[int]:
    return [c["step"] for c in api.get(f"{API}/jobs/{job_id}/checkpoints").json()["checkpoints"]]


def events(api: TestClient, job_id: int) -> list[str]:
    return [e["reason"] or "" for e in api.get(f"{API}/jobs/{job_id}/events").json()["events"]]


def test_keep_one_keeps_the_resumed_from_checkpoint_until_a_newer_one_is_committed(
    api: TestClient, db: Database, store_settings: Settings
) -> None:
    job_id = running_job(db, training={"keep_checkpoints": 1})
    a, b = os.urandom(CHUNK + 5), os.urandom(CHUNK + 7)
    assert upload(api, mint(db, job_id), a, 10, CHUNK).status_code == 201
    requeue(db, job_id)  # attempt 2 resumes from A
    rank = mint(db, job_id, 2)
    r = api.get(API + wire.CHECKPOINT_FILE_PATH.format(step=10), headers=rank)
    assert r.status_code == 200 and r.content == a

    # B on its way, then refused at commit: A must stay (nothing newer is committed).
    uid = begin(api, rank, b, step=20, sha256=sha(b"not b")).json()["upload_id"]
    assert put_chunk(api, rank, uid, 0, b[:CHUNK]).status_code == 200
    assert steps(api, job_id) == [10]
    send_rest(api, rank, uid, b, CHUNK)
    assert commit(api, rank, uid).status_code == 422
    assert steps(api, job_id) == [10], "a failed save deletes nothing"
    assert api.get(f"{API}/jobs/{job_id}/checkpoints/10/file").content == a

    assert upload(api, rank, b, 20, CHUNK).status_code == 201
    assert steps(api, job_id) == [20], "A goes once B is committed"
    assert "checkpoint at step 10 deleted: keep_checkpoints=1 keeps newer ones" in events(
        api, job_id
    )
    assert api.get(f"{API}/jobs/{job_id}/checkpoints/10/file").status_code == 404
    if store_settings.checkpoint_store == "filesystem":
        root = store_settings.resolved_artifact_dir
        ckpt_dir = artifacts.checkpoint_dir(root, job_id)
        assert not list(ckpt_dir.glob("step-10.*")), "its file is deleted"
        assert len(list(ckpt_dir.glob("step-20.*"))) == 1, "B's file is there"


def test_a_checkpoint_named_by_a_running_jobs_init_from_is_pinned(
    api: TestClient, db: Database
) -> None:
    source = running_job(db, training={"keep_checkpoints": 1})
    rank = mint(db, source)
    assert upload(api, rank, os.urandom(99), 10, CHUNK).status_code == 201
    r = api.post(f"{API}/jobs", json={"name": "ft", "task": "regression",
                                      "init_from": {"job": source, "step": 10}})  # fmt: skip
    assert r.status_code == 201, r.text
    follower = r.json()["id"]
    assert upload(api, rank, os.urandom(98), 20, CHUNK).status_code == 201
    assert upload(api, rank, os.urandom(97), 30, CHUNK).status_code == 201
    assert steps(api, source) == [30, 10], "10 is pinned while the follower may still load it"
    assert api.post(f"{API}/jobs/{follower}/cancel").status_code == 202  # queued → cancelled
    assert upload(api, rank, os.urandom(96), 40, CHUNK).status_code == 201
    assert steps(api, source) == [40], "unpinned once the follower is terminal"


def test_shared_filesystem_records_go_through_the_same_retention(
    api: TestClient, db: Database, store_settings: Settings
) -> None:
    if store_settings.checkpoint_store == "database":
        pytest.skip("the database store refuses shared records (test_shared_record_checks.py)")
    job_id = running_job(db, training={"keep_checkpoints": 2})
    rank = mint(db, job_id)
    root = store_settings.resolved_artifact_dir
    for step in (1, 2, 3):
        path = artifacts.checkpoint_path(root, job_id, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"ckpt %d" % step)
        body = {"step": step, "epoch": 0, "path": str(path), "size_bytes": 6,
                "sha256": sha(b"ckpt %d" % step)}  # fmt: skip
        assert api.post(API + wire.CHECKPOINTS_PATH, json=body, headers=rank).status_code == 201
    assert steps(api, job_id) == [3, 2]
    assert not artifacts.checkpoint_path(root, job_id, 1).exists(), "the server deleted it"
    assert "checkpoint at step 1 deleted: keep_checkpoints=2 keeps newer ones" in events(
        api, job_id
    )
    assert api.get(f"{API}/jobs/{job_id}/checkpoints/3/file").content == b"ckpt 3"


def test_the_reaper_cleans_orphaned_partial_uploads(
    api: TestClient, db: Database, store_settings: Settings
) -> None:
    stale_job, superseded_job, live_job = (running_job(db) for _ in range(3))
    data = os.urandom(CHUNK + 1)
    ids = {}
    for job_id in (stale_job, superseded_job, live_job):
        rank = mint(db, job_id)
        ids[job_id] = begin(api, rank, data, step=1).json()["upload_id"]
        assert put_chunk(api, rank, ids[job_id], 0, data[:CHUNK]).status_code == 200
    with db.session() as s:
        s.execute(
            update(CheckpointUpload)
            .where(CheckpointUpload.id == ids[stale_job])
            .values(updated_at=utcnow() - timedelta(hours=2))
        )
    move(db, superseded_job, JobState.RUNNING, JobState.QUEUED)
    stores = checkpoint_stores(api.app)  # type: ignore[arg-type]
    store = stores[store_settings.checkpoint_store]
    assert reap_uploads(db, stores, stale_s=3600) == 2
    with db.session(write=False) as s:
        left = s.scalars(select(CheckpointUpload.id)).all()
    assert left == [ids[live_job]], "only the live upload is kept"
    for job_id in (stale_job, superseded_job):
        assert store.received_size(UploadKey(ids[job_id], job_id, 1)) == 0, "partial dropped"
    assert store.received_size(UploadKey(ids[live_job], live_job, 1)) == CHUNK
    rank = mint(db, live_job)
    send_rest(api, rank, ids[live_job], data, CHUNK)
    assert commit(api, rank, ids[live_job]).status_code == 201, "the live one still commits"
    assert reap_uploads(db, stores, stale_s=3600) == 0, "a committed upload is not an orphan"


def test_a_ranks_deletion_removes_the_stored_bytes_but_never_a_pinned_checkpoint(
    api: TestClient, db: Database, store_settings: Settings
) -> None:
    source = running_job(db, training={"keep_checkpoints": 5})
    rank = mint(db, source)
    for step in (10, 20):
        assert upload(api, rank, os.urandom(CHUNK + step), step, CHUNK).status_code == 201
    r = api.post(f"{API}/jobs", json={"name": "ft", "task": "regression",
                                      "init_from": {"job": source, "step": 10}})  # fmt: skip
    assert r.status_code == 201, r.text
    r = api.post(API + wire.CHECKPOINT_DELETIONS_PATH, json={"steps": [10, 20]}, headers=rank)
    assert r.status_code == 204, r.text
    assert steps(api, source) == [10], "10 is pinned by the follower's init_from"
    store = checkpoint_stores(api.app)[store_settings.checkpoint_store]  # type: ignore[arg-type]
    location = f"jobs/{source}/checkpoints/step-20.pt"
    if store_settings.checkpoint_store == "database":
        with db.session(write=False) as s:
            location = str(s.scalar(select(CheckpointUpload.id).where(CheckpointUpload.step == 20)))
    assert store.size(location) is None, "the server's copy of 20 is gone"


def test_the_reaper_drops_chunk_rows_no_live_checkpoint_names(
    settings: Settings, db: Database
) -> None:
    """The API stopped after retention marked a row deleted but before its chunk rows went:
    the next reaper pass removes them; a live checkpoint's rows stay."""
    in_db = settings.model_copy(
        update={"checkpoint_store": "database", "checkpoint_chunk_bytes": CHUNK}
    )
    job_id = running_job(db, training={"keep_checkpoints": 5})
    rank = mint(db, job_id)
    with TestClient(create_app(in_db)) as api:
        for step in (1, 2):
            assert upload(api, rank, os.urandom(CHUNK + 1), step, CHUNK).status_code == 201
        stores = checkpoint_stores(api.app)  # type: ignore[arg-type]
        with db.session() as s:
            s.execute(
                update(Checkpoint)
                .where(Checkpoint.job_id == job_id, Checkpoint.step == 1)
                .values(deleted_at=utcnow())
            )
        assert reap_uploads(db, stores, stale_s=3600) == 1
        with db.session(write=False) as s:
            held = s.scalars(select(CheckpointChunk.upload_id).distinct()).all()
            live = s.scalar(select(Checkpoint.location).where(Checkpoint.step == 2))
        assert [str(u) for u in held] == [live], "only the live checkpoint's rows are left"
        assert api.get(f"{API}/jobs/{job_id}/checkpoints/2/file").status_code == 200
