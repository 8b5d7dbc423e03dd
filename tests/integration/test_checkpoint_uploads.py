"""Checkpoint uploads through the attempt API into both stores, on SQLite and PostgreSQL:
chunks resume by offset, a corrupted chunk is refused and sent again, nothing is listed or
downloadable before a verified commit, and only the job's own current attempt gets in."""

from __future__ import annotations

import os
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete, func, select

from service.app import create_app
from service.core import artifacts
from service.core.config import Settings
from service.core.wire import attempt as wire
from service.store.db import Database
from service.store.models import CheckpointChunk
from tests.uploads import (
    API,
    begin,
    commit,
    mint,
    put_chunk,
    requeue,
    running_job,
    send_rest,
    sha,
    status,
    upload,
)

CHUNK = 64 * 1024  # the smallest chunk cap the settings allow


@pytest.fixture(params=["filesystem", "database"])
def store_settings(request: pytest.FixtureRequest, settings: Settings) -> Settings:
    # A body cap far below one chunk: chunk PUTs must not be subject to it.
    return settings.model_copy(
        update={
            "auth": "on",
            "checkpoint_store": request.param,
            "checkpoint_chunk_bytes": CHUNK,
            "max_body_bytes": 1024,
        }
    )


@pytest.fixture
def app_settings(store_settings: Settings) -> Settings:
    """What this module's ``api`` serves (tests/conftest.py)."""
    return store_settings


def listed(api: TestClient, user: dict[str, str], job_id: int) -> list[int]:
    r = api.get(f"{API}/jobs/{job_id}/checkpoints", headers=user)
    assert r.status_code == 200, r.text
    return [c["step"] for c in r.json()["checkpoints"]]


def test_chunks_resume_by_offset_and_only_a_commit_lists_the_checkpoint(
    api: TestClient, db: Database, store_settings: Settings, users: dict[str, dict[str, str]]
) -> None:
    job_id = running_job(db)
    rank = mint(db, job_id)
    data = os.urandom(3 * CHUNK + 3392)
    r = begin(api, rank, data, step=40)
    assert r.status_code == 201, r.text
    up = r.json()
    assert (up["received_bytes"], up["chunk_bytes"], up["state"]) == (0, CHUNK, "receiving")
    uid = up["upload_id"]

    assert put_chunk(api, rank, uid, 0, data[:CHUNK]).json()["received_bytes"] == CHUNK
    for wrong in (0, 2 * CHUNK):  # a resend of the chunk just stored, a gap
        r = put_chunk(api, rank, uid, wrong, data[wrong : wrong + CHUNK])
        assert r.status_code == 409, f"offset {wrong}: {r.status_code} {r.text}"
        assert r.json()["detail"]["received_bytes"] == CHUNK, "409 says where to resume"
    r = put_chunk(api, rank, uid, CHUNK, data[CHUNK : 2 * CHUNK + 1])
    assert r.status_code == 422, "a chunk over chunk_bytes is refused"
    r = begin(api, rank, data, step=40)  # the rank restarted its uploader: same upload
    assert (r.status_code, r.json()["upload_id"], r.json()["received_bytes"]) == (200, uid, CHUNK)

    # A partial upload is never listed nor downloadable, nor committable.
    assert listed(api, users["alice"], job_id) == []
    assert api.get(API + wire.CHECKPOINTS_PATH, headers=rank).json() == {"checkpoints": []}
    assert (
        api.get(f"{API}/jobs/{job_id}/checkpoints/40/file", headers=users["alice"]).status_code
        == 404
    )
    assert api.get(API + wire.CHECKPOINT_FILE_PATH.format(step=40), headers=rank).status_code == 404
    r = commit(api, rank, uid)
    assert r.status_code == 409 and r.json()["detail"]["received_bytes"] == CHUNK, r.text

    send_rest(api, rank, uid, data, CHUNK)
    assert status(api, rank, uid).json()["received_bytes"] == len(data)
    r = commit(api, rank, uid)
    assert r.status_code == 201, r.text
    entry = r.json()
    assert (entry["step"], entry["sha256"], entry["size_bytes"]) == (40, sha(data), len(data))
    # The filesystem store keeps it under the upload's own name (never step-40.pt, which a
    # rank sharing the directory or another upload of step 40 may hold).
    own_name = f"step-40.upload-{uid}.pt"
    if store_settings.checkpoint_store == "filesystem":
        assert entry["path"] == f"jobs/{job_id}/checkpoints/{own_name}"
    else:
        assert entry["path"] == f"jobs/{job_id}/checkpoints/step-40.pt"
    again = commit(api, rank, uid)
    assert (again.status_code, again.json()) == (200, entry), "a retried commit is harmless"

    assert listed(api, users["alice"], job_id) == [40]
    one = api.get(f"{API}/jobs/{job_id}/checkpoints", headers=users["alice"]).json()
    assert one["checkpoints"][0]["store"] == store_settings.checkpoint_store
    r = api.get(f"{API}/jobs/{job_id}/checkpoints/40/file", headers=users["alice"])
    assert r.status_code == 200 and r.content == data
    assert r.headers[wire.SHA256_HEADER] == sha(data)
    r = api.get(
        f"{API}/jobs/{job_id}/checkpoints/40/file",
        headers={**users["alice"], "Range": "bytes=100000-"},
    )
    assert r.status_code == 206 and r.content == data[100000:], "a download resumes by Range"
    assert r.headers["content-range"] == f"bytes 100000-{len(data) - 1}/{len(data)}"
    r = api.get(
        API + wire.CHECKPOINT_FILE_PATH.format(step=40), headers={**rank, "Range": "bytes=9-"}
    )
    assert r.status_code == 206 and r.content == data[9:]
    assert r.headers[wire.SHA256_HEADER] == sha(data), "the whole file's sha256"
    r = api.get(
        API + wire.CHECKPOINT_FILE_PATH.format(step=40),
        headers={**rank, "Range": f"bytes={len(data)}-"},
    )
    assert r.status_code == 416, r.text

    root = store_settings.resolved_artifact_dir
    ckpt_dir = artifacts.checkpoint_dir(root, job_id)
    if store_settings.checkpoint_store == "filesystem":
        assert (ckpt_dir / own_name).read_bytes() == data
        assert [p.name for p in ckpt_dir.iterdir()] == [own_name], "no partial left"
    else:
        with db.session(write=False) as s:
            assert s.scalar(select(func.count()).select_from(CheckpointChunk)) == 4
        assert not ckpt_dir.exists() or not any(ckpt_dir.iterdir()), "nothing on disk"


def test_a_corrupted_chunk_is_refused_and_sent_again(
    store_settings: Settings, db: Database, users: dict[str, dict[str, str]]
) -> None:
    faulty = store_settings.model_copy(update={"checkpoint_corrupt_chunk_n": 2})
    job_id = running_job(db)
    rank = mint(db, job_id)
    data = os.urandom(3 * CHUNK)
    with TestClient(create_app(faulty)) as api:
        uid = begin(api, rank, data, step=7).json()["upload_id"]
        assert put_chunk(api, rank, uid, 0, data[:CHUNK]).status_code == 200
        r = put_chunk(api, rank, uid, CHUNK, data[CHUNK : 2 * CHUNK])  # flipped in flight
        assert r.status_code == 422 and "send it again" in r.json()["detail"], r.text
        assert status(api, rank, uid).json()["received_bytes"] == CHUNK, "nothing kept"
        r = put_chunk(api, rank, uid, CHUNK, data[CHUNK : 2 * CHUNK])  # the resend
        assert r.status_code == 200, r.text
        send_rest(api, rank, uid, data, CHUNK)
        assert commit(api, rank, uid).status_code == 201
        r = api.get(f"{API}/jobs/{job_id}/checkpoints/7/file", headers=users["alice"])
        assert r.content == data, "the stored file is the rank's, byte for byte"


def test_a_wrong_whole_file_sha256_commits_nothing(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    job_id = running_job(db)
    rank = mint(db, job_id)
    data = os.urandom(CHUNK + 10)
    claimed = sha(b"other bytes")
    uid = begin(api, rank, data, step=5, sha256=claimed).json()["upload_id"]
    send_rest(api, rank, uid, data, CHUNK)  # each chunk matches its own sha256
    r = commit(api, rank, uid)
    assert r.status_code == 422 and "begin it again" in r.json()["detail"], r.text
    assert listed(api, users["alice"], job_id) == [], "a refused commit lists nothing"
    assert (
        api.get(f"{API}/jobs/{job_id}/checkpoints/5/file", headers=users["alice"]).status_code
        == 404
    )
    assert status(api, rank, uid).json()["state"] == "abandoned"
    r = put_chunk(api, rank, uid, 0, data[:CHUNK])
    assert r.status_code == 409 and r.json()["detail"]["state"] == "abandoned", r.text
    events = api.get(f"{API}/jobs/{job_id}/events", headers=users["alice"]).json()["events"]
    assert any("checkpoint at step 5 not written" in (e["reason"] or "") for e in events)
    # The same step begun again with the right sha256 goes through.
    assert upload(api, rank, data, 5, CHUNK).status_code == 201
    assert listed(api, users["alice"], job_id) == [5]


def test_a_newer_checkpoint_supersedes_a_pending_upload(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    job_id = running_job(db)
    rank = mint(db, job_id)
    old, new = os.urandom(2 * CHUNK), os.urandom(CHUNK)
    uid = begin(api, rank, old, step=10).json()["upload_id"]
    assert put_chunk(api, rank, uid, 0, old[:CHUNK]).status_code == 200
    assert upload(api, rank, new, 20, CHUNK).status_code == 201
    assert status(api, rank, uid).json()["state"] == "abandoned", "only the newest must go"
    assert put_chunk(api, rank, uid, CHUNK, old[CHUNK:]).status_code == 409
    assert listed(api, users["alice"], job_id) == [20]


def test_the_database_store_caps_a_file(settings: Settings, db: Database) -> None:
    capped = settings.model_copy(
        update={"checkpoint_store": "database", "checkpoint_db_max_bytes": 1000}
    )
    job_id = running_job(db)
    rank = mint(db, job_id)
    with TestClient(create_app(capped)) as api:
        r = begin(api, rank, b"x" * 1001, step=1)
        assert r.status_code == 413, r.text
        assert "DDPQ_CHECKPOINT_DB_MAX_BYTES" in r.json()["detail"]
        assert upload(api, rank, b"y" * 1000, 1, CHUNK).status_code == 201, "at the cap: fine"
        assert api.get(API + wire.SELF_PATH, headers=rank).json()["store_id"] is None


def test_upload_routes_let_in_only_the_jobs_current_attempt(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    alice, bob = running_job(db, "alice"), running_job(db, "bob")
    rank, other = mint(db, alice), mint(db, bob)
    data = os.urandom(CHUNK + 1)
    assert upload(api, rank, data, 3, CHUNK).status_code == 201
    uid = begin(api, rank, data, step=4).json()["upload_id"]

    def routes(upload_id: int) -> list[tuple[str, str, Any]]:
        return [
            ("POST", API + wire.UPLOADS_PATH, {"json": {"step": 9, "epoch": 0, "size_bytes": 1,
                                                        "sha256": sha(b"x")}}),
            ("GET", API + wire.UPLOAD_PATH.format(upload_id=upload_id), {}),
            ("PUT", API + wire.UPLOAD_CHUNK_PATH.format(upload_id=upload_id),
             {"params": {"offset": 0}, "content": data[:CHUNK],
              "headers": {wire.CHUNK_SHA256_HEADER: sha(data[:CHUNK])}}),
            ("POST", API + wire.UPLOAD_COMMIT_PATH.format(upload_id=upload_id), {}),
            ("GET", API + wire.CHECKPOINT_FILE_PATH.format(step=3), {}),
            ("GET", API + wire.INIT_FILE_PATH, {}),
        ]  # fmt: skip

    def call(route: tuple[str, str, Any], auth: dict[str, str]) -> Any:
        method, path, kw = route
        headers = {**kw.get("headers", {}), **auth}
        return api.request(method, path, **{**kw, "headers": headers})

    for route in routes(uid):  # a user's token, an admin's included: 401
        for who in (users["alice"], {}):
            r = call(route, who)
            assert r.status_code == 401, f"user token on {route[:2]}: {r.status_code} {r.text}"
    for route in routes(uid)[1:5]:  # bob's rank: alice's upload and checkpoint do not exist
        r = call(route, other)
        assert r.status_code == 404, f"another job's token on {route[:2]}: {r.status_code}"
    assert status(api, rank, uid).json()["received_bytes"] == 0, "bob's PUT wrote nothing"
    r = api.get(f"{API}/jobs/{alice}/checkpoints/3/file", headers=users["bob"])
    assert r.status_code == 404, "another owner cannot download it"
    r = api.get(f"{API}/jobs/{alice}/checkpoints/3/file", headers=rank)
    assert r.status_code == 401, "an attempt token opens no user route"

    requeue(db, alice)  # attempt 2: the old token is superseded everywhere
    for route in routes(uid):
        r = call(route, rank)
        assert r.status_code == 409, f"superseded on {route[:2]}: {r.status_code} {r.text}"
        assert r.json()["detail"].startswith(wire.ATTEMPT_SUPERSEDED)
    rank2 = mint(db, alice, 2)  # the new attempt cannot finish the old one's upload either
    for r in (put_chunk(api, rank2, uid, 0, data[:CHUNK]), commit(api, rank2, uid)):
        assert r.status_code == 409 and r.json()["detail"]["upload_id"] == uid, r.text
    assert status(api, rank2, uid).json()["received_bytes"] == 0
    assert listed(api, users["alice"], alice) == [3]


def test_status_reports_what_the_store_holds_after_a_loss(
    api: TestClient, db: Database, store_settings: Settings, users: dict[str, dict[str, str]]
) -> None:
    """A host crash can lose bytes the database already counted: GET status (and a begin
    that finds the upload again) says where the store really ends, and the upload goes on."""
    job_id = running_job(db)
    rank = mint(db, job_id)
    data = os.urandom(3 * CHUNK)
    uid = begin(api, rank, data, step=9).json()["upload_id"]
    for offset in (0, CHUNK):
        assert put_chunk(api, rank, uid, offset, data[offset : offset + CHUNK]).status_code == 200
    if store_settings.checkpoint_store == "filesystem":
        root = store_settings.resolved_artifact_dir
        partial = artifacts.checkpoint_dir(root, job_id) / f".upload-{uid}.part"
        with partial.open("r+b") as f:
            f.truncate(CHUNK)
    else:
        with db.session() as s:
            s.execute(delete(CheckpointChunk).where(CheckpointChunk.offset_bytes == CHUNK))
    r = put_chunk(api, rank, uid, 2 * CHUNK, data[2 * CHUNK :])
    assert r.status_code == 503, "no chunk lands past a hole: GET status says where to go on"
    assert status(api, rank, uid).json()["received_bytes"] == CHUNK
    send_rest(api, rank, uid, data, CHUNK)
    assert commit(api, rank, uid).status_code == 201
    assert (
        api.get(f"{API}/jobs/{job_id}/checkpoints/9/file", headers=users["alice"]).content == data
    )
