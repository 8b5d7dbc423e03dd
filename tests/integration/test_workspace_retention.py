"""Workspace use cases and retention on SQLite and PostgreSQL, in both stores: a manifest is
read back by its owner or through a job's spec only; the reaper keeps a workspace a queued
job names however old, and deletes an old unreferenced one with the files only it named
(rows and bytes), and abandoned uploads."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update

from service.core.config import Settings
from service.core.errors import JobNotFoundError
from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.store.auth.tokens import create_token
from service.store.db import Database
from service.store.jobs import crud as jobs
from service.store.models import (
    Workspace,
    WorkspaceChunk,
    WorkspaceFile,
    WorkspaceUpload,
    utcnow,
)
from service.store.reaper import reap_once
from service.store.workspaces.service import WorkspaceNotFoundError, get_manifest, job_manifest
from service.store.workspaces.stores import make_workspace_stores, upload_key
from tests.uploads import bearer, move
from tests.workspaces import begin, digest, name_workspace, put_chunk, store_workspace

CHUNK = 64 * 1024


@pytest.fixture(params=["filesystem", "database"])
def app_settings(request: pytest.FixtureRequest, settings: Settings) -> Settings:
    return settings.model_copy(
        update={"checkpoint_store": request.param, "checkpoint_chunk_bytes": CHUNK}
    )


def submit(db: Database, owner: str, workspace: str | None) -> int:
    with db.session() as s:
        job, _ = jobs.submit_job(s, JobSpec(name="w", task="regression"), owner=owner)
        job_id = job.id
    name_workspace(db, job_id, workspace)
    return job_id


def age(db: Database, days: float) -> None:
    """Make every workspace and file last used ``days`` days ago."""
    then = utcnow() - timedelta(days=days)
    with db.session() as s:
        s.execute(update(Workspace).values(last_used_at=then))
        s.execute(update(WorkspaceFile).values(last_used_at=then))
        s.execute(update(WorkspaceUpload).values(updated_at=then))


def test_manifests_are_read_by_owner_or_through_a_jobs_spec(api: TestClient, db: Database) -> None:
    with db.session() as s:
        alice = bearer(create_token(s, owner="alice")[1])
    files = {"a.py": b"a = 1\n"}
    assert store_workspace(api, alice, files).status_code == 201
    owner = app_settings_owner(api)
    assert get_manifest(db, owner, digest(files)).digest() == digest(files)
    with pytest.raises(WorkspaceNotFoundError):
        get_manifest(db, "someone-else", digest(files))
    named = submit(db, owner, digest(files))
    assert job_manifest(db, named).digest() == digest(files)
    with pytest.raises(WorkspaceNotFoundError, match="names no workspace"):
        job_manifest(db, submit(db, owner, None))
    with pytest.raises(WorkspaceNotFoundError):  # the job's owner has no such workspace
        job_manifest(db, submit(db, "someone-else", digest(files)))
    with pytest.raises(JobNotFoundError):
        job_manifest(db, 10**9)


def app_settings_owner(api: TestClient) -> str:
    """Who a caller is with auth off (these tests' default)."""
    return str(api.app.state.settings.default_owner)  # type: ignore[attr-defined]


def test_retention_keeps_what_an_unfinished_job_names_and_deletes_the_rest(
    api: TestClient, db: Database, app_settings: Settings
) -> None:
    user: dict[str, str] = {}
    shared, kept_only, gone_only = b"shared\n", os.urandom(CHUNK + 10), os.urandom(CHUNK + 20)
    kept = {"shared.py": shared, "model.bin": kept_only}
    gone = {"shared.py": shared, "old.bin": gone_only}
    assert store_workspace(api, user, kept).status_code == 201
    assert store_workspace(api, user, gone).status_code == 201
    # An upload left half way, and a finished job naming the old workspace.
    r = begin(api, user, os.urandom(CHUNK + 5))
    half_way = r.json()["upload_id"]
    assert put_chunk(api, user, half_way, 0, b"x" * 10).status_code == 200
    owner = app_settings_owner(api)
    submit(db, owner, digest(kept))  # queued: keeps its workspace
    done = submit(db, owner, digest(gone))
    move(db, done, JobState.QUEUED, JobState.CANCELLED)
    stores = make_workspace_stores(app_settings, db)

    def located(data: bytes) -> tuple[str, str]:
        with db.session() as s:
            row = s.scalars(select(WorkspaceFile).where(WorkspaceFile.size_bytes == len(data)))
            f = row.one()
            return f.store, f.location

    gone_store, gone_location = located(gone_only)
    assert stores[gone_store].size(gone_location) == len(gone_only)
    assert stores[app_settings.checkpoint_store].received_size(upload_key(half_way)) == 10

    reap_once(db, workspace_stores=stores, workspace_retention_days=30)  # nothing old yet
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(Workspace)) == 2

    age(db, 31)
    reap_once(db, workspace_stores=stores, workspace_retention_days=30)
    with db.session() as s:
        assert set(s.scalars(select(Workspace.digest))) == {digest(kept)}
        assert s.scalar(select(func.count()).select_from(WorkspaceFile)) == 2
        assert s.scalar(select(func.count()).select_from(WorkspaceUpload)) == 2  # committed
        chunk_rows = s.scalar(select(func.count()).select_from(WorkspaceChunk))
    assert stores[gone_store].size(gone_location) is None
    assert stores[app_settings.checkpoint_store].received_size(upload_key(half_way)) == 0
    kept_store, kept_location = located(kept_only)
    assert stores[kept_store].size(kept_location) == len(kept_only)
    if app_settings.checkpoint_store == "database":
        assert chunk_rows == 3  # model.bin's two chunks, shared.py's one
    assert api.get(f"/api/v1/workspaces/{digest(kept)}").status_code == 200
    assert api.get(f"/api/v1/workspaces/{digest(gone)}").status_code == 404
