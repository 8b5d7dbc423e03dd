"""init_from in sweeps, on SQLite and PostgreSQL: every trial's is resolved as POST /jobs
resolves a job's (owner check, "latest" made a step, the source pinned against retention),
and retry-failed continues a failed trial from its own newest checkpoint."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from service.core.config import Settings
from service.core.states import JobState
from service.core.wire import attempt as wire
from service.store.checkpoints.retention import pinned_steps
from service.store.db import Database
from service.store.models import Job, JobEvent, Sweep
from tests.uploads import API, claim, mint, move, running_job, sha, upload

CHUNK = 64 * 1024


@pytest.fixture
def app_settings(settings: Settings) -> Settings:
    """What this module's ``api`` serves (tests/conftest.py)."""
    return settings.model_copy(update={"auth": "on", "checkpoint_chunk_bytes": CHUNK})


def sweep_body(init: dict[str, Any] | None, **axes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"name": "b", "task": "regression", "training": {"max_steps": 5}}
    if init is not None:
        base["init_from"] = init
    return {
        "name": "ft",
        "base": base,
        "axes": {"training.lr": {"grid": [0.1, 0.01]}} | axes,
    }


def trial_jobs(api: TestClient, sweep_id: int, who: dict[str, str]) -> list[dict[str, Any]]:
    r = api.get(f"{API}/sweeps/{sweep_id}/trials", headers=who)
    assert r.status_code == 200, r.text
    return [api.get(f"{API}/jobs/{t['job_id']}", headers=who).json() for t in r.json()["trials"]]


def columns(db: Database, job_id: int) -> tuple[int | None, int | None]:
    with db.session(write=False) as s:
        row = s.execute(select(Job.init_from_job_id, Job.init_from_step).where(Job.id == job_id))
        return tuple(row.one())  # type: ignore[return-value]


def sweeps_stored(db: Database) -> int:
    with db.session(write=False) as s:
        return s.scalar(select(func.count()).select_from(Sweep)) or 0


def test_every_trial_starts_from_the_resolved_checkpoint_and_pins_it(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    source = running_job(db, "alice")
    rank = mint(db, source)
    first, second = b"ten" * 100, b"twenty" * 100
    assert upload(api, rank, first, 10, CHUNK).status_code == 201
    assert upload(api, rank, second, 20, CHUNK).status_code == 201
    alice = users["alice"]

    r = api.post(f"{API}/sweeps", json=sweep_body({"job": source}), headers=alice)
    assert r.status_code == 201, r.text
    sweep = r.json()
    resolved = {"job": source, "step": 20, "mode": "weights_only", "sha256": sha(second)}
    jobs = trial_jobs(api, sweep["id"], alice)
    assert len(jobs) == 2
    for job in jobs:
        assert job["spec"]["init_from"] == resolved, '"latest" is the step it meant at submit'
        assert columns(db, job["id"]) == (source, 20)
    with db.session(write=False) as s:
        assert pinned_steps(s, source) == {20}, "queued trials pin their source checkpoint"
    trial_rank = mint_first_claimed(db)
    me = api.get(API + wire.SELF_PATH, headers=trial_rank).json()
    assert me["init_from"]["job_id"] == source and me["init_from"]["step"] == 20

    # Extending later starts the new trials from the very file the first ones did.
    assert upload(api, rank, b"thirty", 30, CHUNK).status_code == 201
    r = api.post(
        f"{API}/sweeps/{sweep['id']}/extend",
        json={"axes": {"training.lr": {"grid": [1.0]}}},
        headers=alice,
    )
    assert r.status_code == 200 and r.json()["added"] == 1, r.text
    added = trial_jobs(api, sweep["id"], alice)[2]
    assert added["spec"]["init_from"] == resolved and columns(db, added["id"]) == (source, 20)

    # An axis over the step: each trial resolves its own.
    body = sweep_body({"job": source}, **{"init_from.step": {"grid": [10, 20]}})
    r = api.post(f"{API}/sweeps", json=body, headers=alice)
    assert r.status_code == 201, r.text
    steps = [j["spec"]["init_from"]["step"] for j in trial_jobs(api, r.json()["id"], alice)]
    assert steps == [10, 20, 10, 20]


def mint_first_claimed(db: Database) -> dict[str, str]:
    """Claim the oldest queued job (a trial) and return its rank's headers."""
    claim(db)
    with db.session(write=False) as s:
        job_id = s.scalar(select(Job.id).where(Job.state == JobState.STARTING.value))
    assert job_id is not None
    return mint(db, job_id)


def test_a_bad_init_from_is_422_naming_the_trial_and_stores_nothing(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    source = running_job(db, "alice")
    assert upload(api, mint(db, source), b"x" * 10, 10, CHUNK).status_code == 201
    before = sweeps_stored(db)

    def refused(body: dict[str, Any], who: str = "alice") -> list[dict[str, Any]]:
        r = api.post(f"{API}/sweeps", json=body, headers=users[who])
        assert r.status_code == 422, f"{r.status_code} {r.text}"
        assert sweeps_stored(db) == before, "nothing stored"
        detail: list[dict[str, Any]] = r.json()["detail"]
        return detail

    # Bob gets exactly what a job that does not exist gets: no hint that alice's is there.
    (theirs,) = refused(sweep_body({"job": source}), "bob")
    (nobody,) = refused(sweep_body({"job": source + 1000}), "bob")
    assert theirs["loc"] == ["body", "base", "init_from", "job"], theirs
    assert theirs["msg"].replace(str(source), "N") == nobody["msg"].replace(str(source + 1000), "N")
    (err,) = refused(sweep_body({"job": source, "step": 15}))
    assert err["loc"] == ["body", "base", "init_from", "step"] and "10" in err["msg"], err

    # An axis value that names no checkpoint: the trials with it, by index and field.
    errs = refused(sweep_body({"job": source}, **{"init_from.step": {"grid": [10, 15]}}))
    assert [e["loc"] for e in errs] == [
        ["body", "trials", 1, "init_from.step"],
        ["body", "trials", 3, "init_from.step"],
    ], errs
    assert errs[0]["msg"].startswith("trial 1 (") and "step 15" in errs[0]["msg"]
    errs = refused(sweep_body(None, **{"init_from.job": {"grid": [source]}}), "bob")
    assert errs[0]["loc"] == ["body", "trials", 0, "init_from.job"], errs


def test_retry_failed_continues_from_the_failed_jobs_newest_checkpoint(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    alice = users["alice"]
    running_job(db, "alice")  # registers worker w1
    r = api.post(f"{API}/sweeps", json=sweep_body(None), headers=alice)
    assert r.status_code == 201, r.text
    sweep_id = r.json()["id"]
    with_ckpt, without = (j["id"] for j in trial_jobs(api, sweep_id, alice))
    data = b"state at step 4" * 50
    for job_id in (with_ckpt, without):
        claim(db)
        move(db, job_id, JobState.STARTING, JobState.RUNNING)
        if job_id == with_ckpt:
            rank = mint(db, job_id)
            assert upload(api, rank, b"older", 2, CHUNK).status_code == 201
            assert upload(api, rank, data, 4, CHUNK).status_code == 201
        move(db, job_id, JobState.RUNNING, JobState.FAILED)

    r = api.post(f"{API}/sweeps/{sweep_id}/retry-failed", headers=users["bob"])
    assert r.status_code == 404, "another owner's sweep is not there"
    r = api.post(f"{API}/sweeps/{sweep_id}/retry-failed", headers=alice)
    assert r.status_code == 200 and r.json()["added"] == 2, r.text
    old = {j["id"]: j for j in (api.get(f"{API}/jobs/{i}", headers=alice).json()
                                for i in (with_ckpt, without))}  # fmt: skip
    cont, fresh = trial_jobs(api, sweep_id, alice)
    assert cont["spec"]["init_from"] == {
        "job": with_ckpt, "step": 4, "mode": "full", "sha256": sha(data)
    }, "it continues from its own newest checkpoint"  # fmt: skip
    assert columns(db, cont["id"]) == (with_ckpt, 4)
    assert cont["spec"] == old[with_ckpt]["spec"] | {"init_from": cont["spec"]["init_from"]}
    assert fresh["spec"] == old[without]["spec"] and columns(db, fresh["id"]) == (None, None)
    with db.session(write=False) as s:
        assert pinned_steps(s, with_ckpt) == {4}, "the checkpoint it continues from is kept"
        reason = s.scalar(select(JobEvent.reason).where(JobEvent.job_id == cont["id"]))
    assert reason is not None and "continuing from its checkpoint at step 4" in reason

    claim(db)  # the continuing trial (the older of the two new jobs)
    me = api.get(API + wire.SELF_PATH, headers=mint(db, cont["id"])).json()
    assert me["init_from"] == {
        "job_id": with_ckpt, "step": 4, "sha256": sha(data), "size_bytes": len(data),
        "mode": "full",
    }  # fmt: skip
