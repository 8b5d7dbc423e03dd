"""init_from in the job spec, on SQLite and PostgreSQL: checked and resolved at submit (only
a job the caller may read, only a committed checkpoint), told to the new job's ranks and
streamed to them; another owner learns nothing about my job."""

from __future__ import annotations

import os
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from service.core.config import Settings
from service.core.wire import attempt as wire
from service.store.auth.tokens import create_token
from service.store.db import Database
from service.store.models import Job
from tests.uploads import API, bearer, claim, mint, running_job, sha, upload

CHUNK = 64 * 1024


@pytest.fixture
def app_settings(settings: Settings) -> Settings:
    """What this module's ``api`` serves (tests/conftest.py)."""
    return settings.model_copy(update={"auth": "on", "checkpoint_chunk_bytes": CHUNK})


@pytest.fixture
def users(db: Database) -> dict[str, dict[str, str]]:
    with db.session() as s:
        tokens = {o: bearer(create_token(s, owner=o)[1]) for o in ("alice", "bob")}
        tokens["root"] = bearer(create_token(s, owner="root", admin=True)[1])
        return tokens


def spec(**init: Any) -> dict[str, Any]:
    return {"name": "ft", "task": "regression", "init_from": init}


def test_init_from_is_resolved_checked_and_streamed_to_the_new_jobs_ranks(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    source = running_job(db, "alice")
    empty = running_job(db, "alice")  # no checkpoint at all
    rank = mint(db, source)
    first, last = os.urandom(CHUNK + 3), os.urandom(2 * CHUNK)
    assert upload(api, rank, first, 10, CHUNK).status_code == 201
    assert upload(api, rank, last, 20, CHUNK).status_code == 201

    r = api.post(f"{API}/jobs", json=spec(job=source), headers=users["alice"])
    assert r.status_code == 201, r.text
    latest = r.json()
    assert latest["spec"]["init_from"] == {
        "job": source, "step": 20, "mode": "weights_only", "sha256": sha(last)
    }, "'latest' is stored as the step and file it meant at submit"  # fmt: skip
    r = api.post(f"{API}/jobs", json=spec(job=source, step=10, mode="full"), headers=users["alice"])
    assert r.status_code == 201 and r.json()["spec"]["init_from"]["sha256"] == sha(first)
    r = api.post(f"{API}/jobs", json=spec(job=source, step=10), headers=users["root"])
    assert r.status_code == 201, "an admin may start from anyone's job"

    def refused(body: dict[str, Any], who: str = "alice") -> dict[str, Any]:
        r = api.post(f"{API}/jobs", json=body, headers=users[who])
        assert r.status_code == 422, f"{body}: {r.status_code} {r.text}"
        (error,) = r.json()["detail"]
        return dict(error)

    err = refused(spec(job=source, step=15))
    assert err["loc"] == ["body", "init_from", "step"] and "20, 10" in err["msg"], err
    err = refused(spec(job=source, step=10, sha256=sha(b"another file")))
    assert err["loc"] == ["body", "init_from", "sha256"], err
    err = refused(spec(job=empty))
    assert err["loc"] == ["body", "init_from", "step"] and "no committed checkpoint" in err["msg"]
    # Bob gets exactly what a job id that does not exist gets: no hint that alice's is there.
    theirs = refused(spec(job=source), "bob")
    nobody = refused(spec(job=source + 1000), "bob")
    assert theirs["loc"] == ["body", "init_from", "job"]
    assert theirs["msg"].replace(str(source), "N") == nobody["msg"].replace(str(source + 1000), "N")
    assert refused(spec(job=source, step="best"))["loc"][:3] == ["body", "init_from", "step"]

    # The new job's rank is told what to load and streams exactly that file.
    claim(db)  # the oldest queued job first: the one of step "latest"
    follower = latest["id"]
    with db.session(write=False) as s:
        row = s.execute(select(Job.init_from_job_id, Job.init_from_step).where(Job.id == follower))
        assert tuple(row.one()) == (source, 20)
    frank = mint(db, follower)
    me = api.get(API + wire.SELF_PATH, headers=frank).json()
    assert me["init_from"] == {
        "job_id": source, "step": 20, "sha256": sha(last), "size_bytes": len(last),
        "mode": "weights_only",
    }  # fmt: skip
    r = api.get(API + wire.INIT_FILE_PATH, headers=frank)
    assert r.status_code == 200 and r.content == last
    assert r.headers[wire.SHA256_HEADER] == sha(last)
    r = api.get(API + wire.INIT_FILE_PATH, headers={**frank, "Range": f"bytes={CHUNK}-"})
    assert r.status_code == 206 and r.content == last[CHUNK:]
    r = api.get(API + wire.INIT_FILE_PATH, headers=rank)
    assert r.status_code == 404, "a job without init_from has no init file"
    assert api.get(API + wire.SELF_PATH, headers=rank).json()["init_from"] is None


def test_a_replayed_submit_with_latest_returns_the_same_job(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    source = running_job(db, "alice")
    rank = mint(db, source)
    assert upload(api, rank, b"one", 1, CHUNK).status_code == 201
    headers = {**users["alice"], "Idempotency-Key": "k1"}
    first = api.post(f"{API}/jobs", json=spec(job=source), headers=headers)
    assert first.status_code == 201, first.text
    assert upload(api, rank, b"two", 2, CHUNK).status_code == 201  # "latest" moved on
    again = api.post(f"{API}/jobs", json=spec(job=source), headers=headers)
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"], again.text
    assert again.json()["spec"]["init_from"]["step"] == 1
