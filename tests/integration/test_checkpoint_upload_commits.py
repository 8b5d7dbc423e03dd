"""Committing checkpoint uploads safely, on SQLite and PostgreSQL, in both stores: a commit
refused after its bytes were finalized overwrites no committed file and leaves nothing
listed; a commit retried after the API stopped mid-commit goes through; the whole file's
sha256 comes from the chunks as they arrived (read back only for bytes this process did not
follow); a stored file of another size than recorded is refused before any byte; an empty
upload is refused; a row replaced at the same step lets its old bytes go."""

from __future__ import annotations

import os
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete, func, select

from service.api.files import checkpoint_stores
from service.app import create_app
from service.core import artifacts
from service.core.config import Settings
from service.core.wire import attempt as wire
from service.store.db import Database
from service.store.models import CheckpointChunk
from service.store.reaper import reap_uploads
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
    return settings.model_copy(
        update={"auth": "on", "checkpoint_store": request.param, "checkpoint_chunk_bytes": CHUNK}
    )


@pytest.fixture
def app_settings(store_settings: Settings) -> Settings:
    """What this module's ``api`` serves (tests/conftest.py)."""
    return store_settings


def listed(api: TestClient, user: dict[str, str], job_id: int) -> list[int]:
    r = api.get(f"{API}/jobs/{job_id}/checkpoints", headers=user)
    assert r.status_code == 200, r.text
    return [c["step"] for c in r.json()["checkpoints"]]


class _FinalizeHook:
    """The app's real store, with ``hook`` run around its ``finalize`` (``before``: the
    attempt superseded just before the file is renamed; ``after``: the API stopped between
    the rename and the commit)."""

    def __init__(self, store: Any, before: Any = None, after: Any = None) -> None:
        self._store, self._before, self._after = store, before, after
        self.read_backs = 0

    def partial_sha256(self, key: Any) -> str:
        self.read_backs += 1
        return str(self._store.partial_sha256(key))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def finalize(self, key: Any) -> str:
        if self._before is not None:
            self._before()
        location = self._store.finalize(key)
        if self._after is not None:
            after, self._after = self._after, None
            after()
        return location


def _hook_store(api: TestClient, settings: Settings, **hooks: Any) -> dict[str, Any]:
    stores = checkpoint_stores(api.app)  # type: ignore[arg-type]
    name = settings.checkpoint_store
    stores[name] = _FinalizeHook(stores[name], **hooks)
    return stores


def test_the_commit_reads_the_file_back_only_for_bytes_it_did_not_follow(
    api: TestClient, db: Database, store_settings: Settings, users: dict[str, dict[str, str]]
) -> None:
    """Chunks all taken by this process: the commit checks the sha256 hashed on the way
    in, without reading the file back. After a restart mid-upload it reads it back; a file
    that does not match its sha256 is refused either way."""
    job_id = running_job(db)
    rank = mint(db, job_id)
    hooked = _hook_store(api, store_settings)[store_settings.checkpoint_store]
    data = os.urandom(3 * CHUNK + 11)
    assert upload(api, rank, data, 1, CHUNK).status_code == 201
    assert hooked.read_backs == 0, "the running sha256 sufficed"

    data2 = os.urandom(3 * CHUNK + 11)
    uid = begin(api, rank, data2, step=2).json()["upload_id"]
    assert put_chunk(api, rank, uid, 0, data2[:CHUNK]).status_code == 200
    api.app.state.upload_hashes = None  # type: ignore[attr-defined]  # the API restarted
    send_rest(api, rank, uid, data2, CHUNK)
    assert commit(api, rank, uid).status_code == 201
    assert hooked.read_backs == 1, "bytes it did not follow: read back"

    data4 = os.urandom(2 * CHUNK)  # all followed, then the store lost bytes: read back
    uid = begin(api, rank, data4, step=4).json()["upload_id"]
    send_rest(api, rank, uid, data4, CHUNK)
    if store_settings.checkpoint_store == "filesystem":
        root = store_settings.resolved_artifact_dir
        partial = artifacts.checkpoint_dir(root, job_id) / f".upload-{uid}.part"
        with partial.open("r+b") as f:
            f.truncate(CHUNK)
    else:
        with db.session() as s:
            s.execute(
                delete(CheckpointChunk).where(
                    CheckpointChunk.upload_id == uid, CheckpointChunk.offset_bytes == CHUNK
                )
            )
    assert commit(api, rank, uid).status_code in (409, 422), "a short file never commits"
    assert hooked.read_backs == 2 and listed(api, users["alice"], job_id) == [2, 1]

    data3 = os.urandom(2 * CHUNK)
    r = begin(api, rank, data3, step=3, sha256="0" * 64)
    send_rest(api, rank, r.json()["upload_id"], data3, CHUNK)
    assert commit(api, rank, r.json()["upload_id"]).status_code == 422
    assert hooked.read_backs == 2 and listed(api, users["alice"], job_id) == [2, 1]


def test_a_commit_fenced_off_after_finalize_leaves_the_committed_file_alone(
    api: TestClient, db: Database, store_settings: Settings, users: dict[str, dict[str, str]]
) -> None:
    """Step 10 is committed; the attempt uploads step 10 again (other bytes) and is
    superseded while its commit finalizes: the commit is refused, step 10 still downloads
    as committed (its bytes untouched), and the reaper drops the refused upload's file."""
    job_id = running_job(db)
    rank = mint(db, job_id)
    first, second = os.urandom(2 * CHUNK + 5), os.urandom(2 * CHUNK + 5)
    assert upload(api, rank, first, 10, CHUNK).status_code == 201
    stores = _hook_store(api, store_settings, before=lambda: requeue(db, job_id))
    uid = begin(api, rank, second, step=10).json()["upload_id"]
    send_rest(api, rank, uid, second, CHUNK)
    r = commit(api, rank, uid)
    assert r.status_code == 409 and r.json()["detail"].startswith(wire.ATTEMPT_SUPERSEDED)

    assert listed(api, users["alice"], job_id) == [10]
    r = api.get(f"{API}/jobs/{job_id}/checkpoints/10/file", headers=users["alice"])
    assert r.status_code == 200 and r.headers[wire.SHA256_HEADER] == sha(first)
    assert r.content == first, "the committed bytes were not overwritten"

    assert reap_uploads(db, stores, stale_s=3600) == 1, "the superseded upload is dropped"
    if store_settings.checkpoint_store == "filesystem":
        ckpt_dir = artifacts.checkpoint_dir(store_settings.resolved_artifact_dir, job_id)
        assert [p.name for p in ckpt_dir.iterdir() if str(uid) in p.name] == []
    r = api.get(f"{API}/jobs/{job_id}/checkpoints/10/file", headers=users["alice"])
    assert r.content == first


def test_a_commit_retried_after_the_api_stopped_past_finalize_commits(
    db: Database, store_settings: Settings, users: dict[str, dict[str, str]]
) -> None:
    """The API stops between the file's rename and the row: the upload still counts every
    byte, and a retried commit verifies the renamed file and commits it."""

    def stop() -> None:
        raise RuntimeError("the API process stops here")

    with TestClient(create_app(store_settings), raise_server_exceptions=False) as api:
        job_id = running_job(db)
        rank = mint(db, job_id)
        data = os.urandom(2 * CHUNK + 7)
        _hook_store(api, store_settings, after=stop)
        uid = begin(api, rank, data, step=5).json()["upload_id"]
        send_rest(api, rank, uid, data, CHUNK)
        assert commit(api, rank, uid).status_code == 500
        assert listed(api, users["alice"], job_id) == []
        assert status(api, rank, uid).json()["received_bytes"] == len(data)
        api.app.state.upload_hashes = {}  # type: ignore[attr-defined]  # a restarted process
        r = commit(api, rank, uid)
        assert r.status_code == 201, r.text
        assert listed(api, users["alice"], job_id) == [5]
        r = api.get(f"{API}/jobs/{job_id}/checkpoints/5/file", headers=users["alice"])
        assert r.content == data


def test_a_stored_file_of_another_size_is_refused_before_any_byte(
    api: TestClient, db: Database, store_settings: Settings, users: dict[str, dict[str, str]]
) -> None:
    """The stored copy shrank after its commit (a truncated file, a lost chunk row): every
    download answers 410 with what the store holds and what was recorded, not a body cut
    short of its Content-Length (which a receiver would take for a network fault)."""
    job_id = running_job(db)
    rank = mint(db, job_id)
    data = os.urandom(3 * CHUNK)
    assert upload(api, rank, data, 7, CHUNK).status_code == 201
    if store_settings.checkpoint_store == "filesystem":
        [stored] = artifacts.checkpoint_dir(store_settings.resolved_artifact_dir, job_id).iterdir()
        with stored.open("r+b") as f:
            f.truncate(CHUNK)
    else:
        with db.session() as s:
            s.execute(delete(CheckpointChunk).where(CheckpointChunk.offset_bytes == CHUNK))
    for headers, path in (
        (users["alice"], f"{API}/jobs/{job_id}/checkpoints/7/file"),
        (rank, API + wire.CHECKPOINT_FILE_PATH.format(step=7)),
        ({**rank, "Range": "bytes=10-"}, API + wire.CHECKPOINT_FILE_PATH.format(step=7)),
    ):
        r = api.get(path, headers=headers)
        assert r.status_code == 410, f"{path}: {r.status_code}"
        assert r.json()["detail"].startswith(f"stored file is {CHUNK} bytes, recorded {3 * CHUNK}")


def test_a_zero_byte_upload_is_refused_at_begin(api: TestClient, db: Database) -> None:
    """A checkpoint file is never empty: begin answers 422 naming size_bytes (an empty file
    would hold no chunk, and the database store would then read it as missing)."""
    rank = mint(db, running_job(db))
    r = begin(api, rank, b"", step=1)
    assert r.status_code == 422 and "size_bytes" in r.text, r.text


def test_a_shared_record_of_an_uploaded_step_lets_the_uploaded_bytes_go(
    api: TestClient, db: Database, store_settings: Settings, users: dict[str, dict[str, str]]
) -> None:
    """Step 5 uploaded, then recorded again by a rank sharing the API's directory (its own
    file, step-5.pt): the row names the new file and the uploaded bytes leave the store."""
    if store_settings.checkpoint_store == "database":
        pytest.skip("the database store refuses shared records (test_shared_record_checks.py)")
    job_id = running_job(db)
    rank = mint(db, job_id)
    assert upload(api, rank, os.urandom(CHUNK + 1), 5, CHUNK).status_code == 201
    root = store_settings.resolved_artifact_dir
    path = artifacts.checkpoint_path(root, job_id, 5)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"shared copy")
    body = {"step": 5, "epoch": 0, "path": str(path), "size_bytes": 11,
            "sha256": sha(b"shared copy")}  # fmt: skip
    assert api.post(API + wire.CHECKPOINTS_PATH, json=body, headers=rank).status_code == 201
    r = api.get(f"{API}/jobs/{job_id}/checkpoints/5/file", headers=users["alice"])
    assert r.content == b"shared copy"
    assert [p.name for p in artifacts.checkpoint_dir(root, job_id).iterdir()] == ["step-5.pt"]
    with db.session(write=False) as s:
        assert s.scalar(select(func.count()).select_from(CheckpointChunk)) == 0
