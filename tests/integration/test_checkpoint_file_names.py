"""A followed checkpoint's workspace file name (``file_name``) through the attempt API, on SQLite
and PostgreSQL: a recorded checkpoint (shared filesystem) and an uploaded one (either store)
keep it, the attempt API's list and the user's list return it, a checkpoint without one says
null, and a name that is not a workspace path is a 422 that stores nothing."""

from __future__ import annotations

import os
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.core import artifacts
from service.core.config import Settings
from service.core.wire import attempt as wire
from service.store.auth.tokens import create_token
from service.store.db import Database
from tests.uploads import API, bearer, begin, commit, mint, running_job, send_rest, sha, upload

CHUNK = 64 * 1024  # the smallest chunk cap the settings allow
BAD_NAMES = ["", "/etc/passwd", "../outside.pt", "ckpt//a.pt", "ckpt/./a.pt", "a\\b.pt", "a\x00b"]


@pytest.fixture(params=["filesystem", "database"])
def store_settings(request: pytest.FixtureRequest, settings: Settings) -> Settings:
    return settings.model_copy(
        update={"auth": "on", "checkpoint_store": request.param, "checkpoint_chunk_bytes": CHUNK}
    )


@pytest.fixture
def app_settings(store_settings: Settings) -> Settings:
    """What this module's ``api`` serves (tests/conftest.py)."""
    return store_settings


@pytest.fixture
def owner(db: Database) -> dict[str, str]:
    with db.session() as s:
        return bearer(create_token(s, owner="alice")[1])


def user_list(api: TestClient, owner: dict[str, str], job_id: int) -> dict[int, Any]:
    r = api.get(f"{API}/jobs/{job_id}/checkpoints", headers=owner)
    assert r.status_code == 200, r.text
    return {c["step"]: c.get("file_name") for c in r.json()["checkpoints"]}


def rank_list(api: TestClient, rank: dict[str, str]) -> dict[int, Any]:
    r = api.get(API + wire.CHECKPOINTS_PATH, headers=rank)
    assert r.status_code == 200, r.text
    return {c["step"]: c.get("file_name") for c in r.json()["checkpoints"]}


def record_body(settings: Settings, job_id: int, step: int, **extra: Any) -> dict[str, Any]:
    """A checkpoint file in the API's own directory, as a rank sharing it writes one."""
    data = os.urandom(1000)
    path = artifacts.checkpoint_path(settings.resolved_artifact_dir, job_id, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    body = {"step": step, "epoch": 0, "path": str(path), "size_bytes": len(data)}
    return body | {"sha256": sha(data)} | extra


def test_a_recorded_checkpoint_keeps_its_file_name(
    api: TestClient, db: Database, store_settings: Settings, owner: dict[str, str]
) -> None:
    if store_settings.checkpoint_store != "filesystem":
        pytest.skip("records need the filesystem store (the database store takes uploads)")
    job_id = running_job(db)
    rank = mint(db, job_id)
    body = record_body(store_settings, job_id, 10, file_name="ckpt/epoch-3.pt")
    r = api.post(API + wire.CHECKPOINTS_PATH, json=body, headers=rank)
    assert r.status_code == 201, r.text
    assert r.json()["file_name"] == "ckpt/epoch-3.pt"
    r = api.post(API + wire.CHECKPOINTS_PATH, json=record_body(store_settings, job_id, 20),
                 headers=rank)  # fmt: skip
    assert r.status_code == 201, r.text
    expected = {20: None, 10: "ckpt/epoch-3.pt"}
    assert rank_list(api, rank) == expected, "the attempt API lists it (for restore)"
    assert user_list(api, owner, job_id) == expected, "and so does the user's list"


def test_an_uploaded_checkpoint_keeps_its_file_name(
    api: TestClient, db: Database, owner: dict[str, str]
) -> None:
    job_id = running_job(db)
    rank = mint(db, job_id)
    data = os.urandom(2 * CHUNK + 100)
    r = begin(api, rank, data, step=7, file_name="snapshot.pt")
    assert r.status_code == 201, r.text
    upload_id = r.json()["upload_id"]
    again = begin(api, rank, data, step=7, file_name="snapshot.pt")
    assert (again.status_code, again.json()["upload_id"]) == (200, upload_id), "resumable"
    send_rest(api, rank, upload_id, data, CHUNK)
    r = commit(api, rank, upload_id)
    assert r.status_code == 201, r.text
    assert r.json()["file_name"] == "snapshot.pt"
    assert upload(api, rank, os.urandom(500), step=8, chunk=CHUNK).status_code == 201
    expected = {8: None, 7: "snapshot.pt"}
    assert rank_list(api, rank) == expected
    assert user_list(api, owner, job_id) == expected


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_file_name_outside_the_workspace_is_a_422_and_stores_nothing(
    api: TestClient, db: Database, store_settings: Settings, name: str
) -> None:
    job_id = running_job(db)
    rank = mint(db, job_id)
    data = os.urandom(100)
    r = begin(api, rank, data, step=5, file_name=name)
    assert r.status_code == 422, r.text
    assert "file_name" in r.text
    body = record_body(store_settings, job_id, 6, file_name=name)
    r = api.post(API + wire.CHECKPOINTS_PATH, json=body, headers=rank)
    assert r.status_code == 422, r.text
    assert "file_name" in r.text, "refused for its name, before the store is asked"
    assert rank_list(api, rank) == {}
