"""The workspace routes on SQLite and PostgreSQL, into both stores, with auth on: uploads
resume by offset and refuse damaged chunks, incomplete or mismatched files; a manifest is
stored only over uploaded files and within the limits; the ranks read only their own job's
workspace; and nobody reaches what is not theirs (another owner: 404; the wrong kind of
token: 401)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.core.config import Settings
from service.core.wire import workspace as wire
from service.core.wire.attempt import SHA256_HEADER
from service.store.db import Database
from service.store.models import WorkspaceUpload
from service.store.workspaces.stores import make_workspace_stores, upload_key
from tests.uploads import mint, running_job
from tests.workspaces import (
    API,
    begin,
    commit,
    digest,
    manifest,
    name_workspace,
    put_chunk,
    sha,
    store_workspace,
    upload,
)

CHUNK = 64 * 1024  # the smallest chunk cap the settings allow


@pytest.fixture(params=["filesystem", "database"])
def app_settings(request: pytest.FixtureRequest, settings: Settings) -> Settings:
    # A body cap far below one chunk and below a big manifest: neither may be held to it.
    return settings.model_copy(
        update={
            "auth": "on",
            "checkpoint_store": request.param,
            "checkpoint_chunk_bytes": CHUNK,
            "max_body_bytes": 4096,
        }
    )


def test_a_file_resumes_by_offset_refuses_damage_and_commits_once_whole(
    api: TestClient, users: dict[str, dict[str, str]]
) -> None:
    alice, bob = users["alice"], users["bob"]
    data = os.urandom(2 * CHUNK + 100)
    r = begin(api, alice, data)
    assert r.status_code == 201, r.text
    up = r.json()
    assert (up["received_bytes"], up["chunk_bytes"], up["state"]) == (0, CHUNK, "receiving")
    uid = up["upload_id"]
    assert put_chunk(api, alice, uid, 0, data[:CHUNK]).json()["received_bytes"] == CHUNK

    again = begin(api, alice, data)  # the client restarted: resume where the server is
    assert again.status_code == 200 and again.json()["upload_id"] == uid
    assert again.json()["received_bytes"] == CHUNK
    stale = put_chunk(api, alice, uid, 0, data[:CHUNK])
    assert stale.status_code == 409 and stale.json()["code"] == "upload_state"
    assert stale.json()["detail"]["received_bytes"] == CHUNK
    damaged = put_chunk(api, alice, uid, CHUNK, data[CHUNK : 2 * CHUNK], digest=sha(b"other"))
    assert damaged.status_code == 422, damaged.text
    early = commit(api, alice, uid)
    assert early.status_code == 409 and early.json()["detail"]["received_bytes"] == CHUNK

    for who in (bob,):  # another owner's upload is not there at all
        path = API + wire.FILE_UPLOAD_PATH.format(upload_id=uid)
        assert api.get(path, headers=who).status_code == 404
        assert put_chunk(api, who, uid, CHUNK, data[CHUNK : 2 * CHUNK]).status_code == 404
        assert commit(api, who, uid).status_code == 404

    assert put_chunk(api, alice, uid, CHUNK, data[CHUNK : 2 * CHUNK]).status_code == 200
    assert put_chunk(api, alice, uid, 2 * CHUNK, data[2 * CHUNK :]).status_code == 200
    path = API + wire.FILE_UPLOAD_PATH.format(upload_id=uid)
    assert api.get(path, headers=alice).json()["received_bytes"] == len(data)
    done = commit(api, alice, uid)
    assert done.status_code == 200 and done.json()["state"] == "committed", done.text
    assert commit(api, alice, uid).json()["state"] == "committed"  # repeated: the same
    had = begin(api, alice, data)
    assert had.status_code == 200 and had.json()["state"] == "committed"

    files = {"files": [{"sha256": sha(data), "size_bytes": len(data)}]}
    missing = API + wire.MISSING_PATH
    assert api.post(missing, json=files, headers=alice).json() == {"missing": []}
    # A file another owner uploaded is missing for you.
    assert api.post(missing, json=files, headers=bob).json() == {"missing": [sha(data)]}


def test_a_file_whose_sha256_does_not_match_is_discarded(
    api: TestClient, users: dict[str, dict[str, str]]
) -> None:
    alice = users["alice"]
    meant, sent = b"a" * 1000, b"b" * 1000
    up = api.post(
        API + wire.FILES_PATH, json={"sha256": sha(meant), "size_bytes": 1000}, headers=alice
    ).json()
    assert put_chunk(api, alice, up["upload_id"], 0, sent).status_code == 200
    r = commit(api, alice, up["upload_id"])
    assert r.status_code == 422 and "begin it again" in r.json()["detail"], r.text
    path = API + wire.FILE_UPLOAD_PATH.format(upload_id=up["upload_id"])
    assert api.get(path, headers=alice).json()["state"] == "abandoned"
    fresh = begin(api, alice, meant)
    assert fresh.status_code == 201 and fresh.json()["upload_id"] != up["upload_id"]


def test_of_two_uploads_of_one_content_the_first_commit_counts(
    api: TestClient, db: Database, app_settings: Settings, users: dict[str, dict[str, str]]
) -> None:
    alice = users["alice"]
    data = os.urandom(1000)
    first = begin(api, alice, data).json()["upload_id"]
    with db.session() as s:  # another request began the same file at the same moment
        row = WorkspaceUpload(owner="alice", sha256=sha(data), size_bytes=len(data),
                              received_bytes=0, state="receiving",
                              store=app_settings.checkpoint_store)  # fmt: skip
        s.add(row)
        s.flush()
        second = row.id
    make_workspace_stores(app_settings, db)[app_settings.checkpoint_store].begin(upload_key(second))
    for uid in (first, second):
        assert put_chunk(api, alice, uid, 0, data).status_code == 200
    assert commit(api, alice, first).json()["state"] == "committed"
    lost = commit(api, alice, second)
    assert lost.status_code == 200, lost.text
    assert (lost.json()["upload_id"], lost.json()["state"]) == (first, "committed")
    path = API + wire.FILE_UPLOAD_PATH.format(upload_id=second)
    assert api.get(path, headers=alice).json()["state"] == "abandoned"  # the reaper drops it


def test_an_empty_file_is_begun_then_committed_with_no_chunk(
    api: TestClient, users: dict[str, dict[str, str]]
) -> None:
    alice = users["alice"]
    r = begin(api, alice, b"")
    assert r.status_code == 201 and r.json()["state"] == "receiving", r.text
    done = commit(api, alice, r.json()["upload_id"])
    assert done.status_code == 200 and done.json()["state"] == "committed", done.text
    missing = {"files": [{"sha256": sha(b""), "size_bytes": 0}]}
    assert api.post(API + wire.MISSING_PATH, json=missing, headers=alice).json()["missing"] == []


def test_workspaces_are_stored_over_uploaded_files_only_and_read_by_their_owner_only(
    api: TestClient, users: dict[str, dict[str, str]]
) -> None:
    alice, bob = users["alice"], users["bob"]
    files = {"train.py": b"print(1)\n", "pkg/__init__.py": b"", "data.bin": os.urandom(CHUNK + 1)}
    body = {"manifest": manifest(files)}
    upload(api, alice, files["train.py"])
    r = api.post(API + wire.WORKSPACES_PATH, json=body, headers=alice)
    assert r.status_code == 422 and r.json()["code"] == "workspace_files_missing", r.text
    absent = {e["msg"].split("'")[1] for e in r.json()["detail"]}
    assert absent == {"pkg/__init__.py", "data.bin"}
    assert all(e["loc"][:3] == ["body", "manifest", "files"] for e in r.json()["detail"])

    created = store_workspace(api, alice, files)  # the empty file: begin, then commit
    assert created.status_code == 201, created.text
    summary = created.json()
    assert summary == {
        "digest": digest(files),
        "file_count": 3,
        "total_bytes": sum(len(d) for d in files.values()),
    }
    again = api.post(API + wire.WORKSPACES_PATH, json=body, headers=alice)
    assert again.status_code == 200 and again.json() == summary

    path = API + wire.WORKSPACE_PATH.format(digest=summary["digest"])
    got = api.get(path, headers=alice)
    assert got.status_code == 200
    assert wire.Manifest.model_validate(got.json()).digest() == summary["digest"]
    theirs = api.get(path, headers=bob)
    nobody = api.get(API + wire.WORKSPACE_PATH.format(digest="0" * 64), headers=alice)
    assert theirs.status_code == nobody.status_code == 404
    assert theirs.json()["code"] == nobody.json()["code"] == "workspace_not_found"
    # bob has none of alice's files: storing the same manifest is his 422.
    r = api.post(API + wire.WORKSPACES_PATH, json=body, headers=bob)
    assert r.status_code == 422 and len(r.json()["detail"]) == 3


def test_bad_and_big_manifests_are_refused_with_what_to_fix(
    api: TestClient, app_settings: Settings, db: Database, users: dict[str, dict[str, str]]
) -> None:
    alice = users["alice"]
    bad = {"manifest": {"files": [{"path": "../x", "mode": 0o644, "size_bytes": 1,
                                   "sha256": "a" * 64}]}}  # fmt: skip
    r = api.post(API + wire.WORKSPACES_PATH, json=bad, headers=alice)
    assert r.status_code == 422 and r.json()["code"] == "invalid_request", r.text
    assert "'..'" in r.json()["detail"][0]["msg"]
    r = api.post(API + wire.FILES_PATH, json={"sha256": "a" * 64, "size_bytes": False},
                 headers=alice)  # fmt: skip
    assert r.status_code == 422  # not a file of 0 bytes
    # The digest route takes only a sha256: these paths are not a workspace to GET.
    for path in (wire.FILES_PATH, wire.MISSING_PATH):
        r = api.get(API + path, headers=alice)
        assert r.status_code == 405 and r.headers["Allow"] == "POST", (path, r.text)
    # Bigger than max_body_bytes (4096) but a manifest: answered on its content, not 413.
    many = {f"src/m{i:03}.py": f"x = {i}\n".encode() for i in range(200)}
    r = api.post(API + wire.WORKSPACES_PATH, json={"manifest": manifest(many)}, headers=alice)
    assert r.status_code == 422 and r.json()["code"] == "workspace_files_missing"
    assert len(r.json()["detail"]) == 51  # 50 listed, then "and 150 more"

    small = app_settings.model_copy(update={"workspace_max_bytes": 3000})
    with TestClient(create_app(small)) as tight:
        files = {"a.bin": b"a" * 2000, "b.bin": b"b" * 1500}
        r = tight.post(API + wire.WORKSPACES_PATH, json={"manifest": manifest(files)},
                       headers=alice)  # fmt: skip
        assert r.status_code == 413 and r.json()["code"] == "workspace_too_large", r.text
        assert wire.MAX_BYTES_SETTING in r.json()["detail"]
        assert "a.bin" in r.json()["detail"]
        r = begin(tight, alice, b"c" * 4000)  # one file alone over the limit
        assert r.status_code == 413 and wire.MAX_BYTES_SETTING in r.json()["detail"]


def test_ranks_read_their_own_jobs_workspace_only(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    alice = users["alice"]
    big = os.urandom(CHUNK + 500)
    files = {"train.py": b"print(1)\n", "empty.txt": b"", "big.bin": big}
    assert store_workspace(api, alice, files).status_code == 201
    upload(api, alice, b"not in the workspace")
    job_id = running_job(db, owner="alice")
    name_workspace(db, job_id, digest(files))
    rank = mint(db, job_id)

    r = api.get(API + wire.ATTEMPT_WORKSPACE_PATH, headers=rank)
    assert r.status_code == 200, r.text
    assert wire.Manifest.model_validate(r.json()).digest() == digest(files)
    file_path = API + wire.ATTEMPT_WORKSPACE_FILE_PATH
    r = api.get(file_path.format(sha256=sha(big)), headers=rank)
    assert r.status_code == 200 and r.content == big and r.headers[SHA256_HEADER] == sha(big)
    r = api.get(file_path.format(sha256=sha(big)), headers={**rank, "Range": "bytes=1000-"})
    assert r.status_code == 206 and r.content == big[1000:]
    r = api.get(file_path.format(sha256=sha(b"")), headers=rank)
    assert r.status_code == 200 and r.content == b""
    outside = api.get(file_path.format(sha256=sha(b"not in the workspace")), headers=rank)
    assert outside.status_code == 404

    # A user token on the ranks' routes, and a rank's token on the users' routes: 401.
    assert api.get(API + wire.ATTEMPT_WORKSPACE_PATH, headers=alice).status_code == 401
    assert api.get(file_path.format(sha256=sha(big)), headers=alice).status_code == 401
    user_routes: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", wire.MISSING_PATH, {"json": {"files": []}}),
        ("POST", wire.FILES_PATH, {"json": {"sha256": sha(b"x"), "size_bytes": 1}}),
        ("GET", wire.FILE_UPLOAD_PATH.format(upload_id=1), {}),
        ("PUT", wire.FILE_CHUNK_PATH.format(upload_id=1),
         {"params": {"offset": 0}, "content": b"x"}),
        ("POST", wire.FILE_COMMIT_PATH.format(upload_id=1), {}),
        ("POST", wire.FILES_BATCH_PATH, {"content": b'{"files": []}\n'}),
        ("POST", wire.WORKSPACES_PATH, {"json": {"manifest": manifest(files)}}),
        ("GET", wire.WORKSPACE_PATH.format(digest=digest(files)), {}),
    ]  # fmt: skip
    for method, path, kwargs in user_routes:
        r = api.request(method, API + path, headers=rank, **kwargs)
        assert r.status_code == 401, (method, path, r.text)

    # A job whose spec names no workspace, or one its owner does not have: 404.
    name_workspace(db, job_id, None)
    assert api.get(API + wire.ATTEMPT_WORKSPACE_PATH, headers=rank).status_code == 404
    assert api.get(file_path.format(sha256=sha(big)), headers=rank).status_code == 404
    name_workspace(db, job_id, "1" * 64)
    assert api.get(API + wire.ATTEMPT_WORKSPACE_PATH, headers=rank).status_code == 404
    # bob's job naming alice's digest: looked up for bob, so not found.
    bobs = running_job(db, owner="bob")
    name_workspace(db, bobs, digest(files))
    r = api.get(API + wire.ATTEMPT_WORKSPACE_PATH, headers=mint(db, bobs))
    assert r.status_code == 404 and r.json()["code"] == "workspace_not_found"
