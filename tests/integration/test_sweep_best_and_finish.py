"""Which trial is a sweep's best, and when a cancelled sweep has finished, over the real app
on SQLite and PostgreSQL: a failed or cancelled trial is never best (a running one may be,
labelled); ``finished_at`` waits for the last trial to end."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.store.db import Database
from service.store.jobs import crud as jobs
from service.store.models import Job
from service.store.sweeps.progress import advance_sweeps, has_running_sweeps
from service.store.workers import registry as workers

API = API_PREFIX
SWEEP: dict[str, Any] = {
    "name": "best",
    "base": {"name": "b", "task": "regression", "training": {"max_steps": 5}},
    "axes": {"training.lr": {"grid": [0.001, 0.01, 0.1, 0.2]}},
}
ORDER = [JobState.QUEUED, JobState.STARTING, JobState.RUNNING]


def drive(db: Database, job_id: int, to: JobState, loss: float | None = None) -> None:
    """Move a job on from where it is to ``to`` (through starting and running)."""
    with db.session() as s:
        workers.register_worker(
            s, worker_id="w", host="h", pid=1, launcher="local", capacity={"slots": 100}
        )
        job = s.get(Job, job_id)
        assert job is not None
        at = JobState(job.state)
        path = ORDER[ORDER.index(at) + 1 :]
        path = path[: ORDER.index(to) - ORDER.index(at)] if to in ORDER else [*path, to]
        for nxt in path:
            jobs.apply_transition(s, jobs.Transition(job_id, at, nxt, "test"))
            at = nxt
        if loss is not None:
            job.latest_metrics = {"loss": {"value": loss, "step": 3}}


def best(api: TestClient, sweep_id: int) -> dict[str, Any] | None:
    out: dict[str, Any] | None = api.get(f"{API}/sweeps/{sweep_id}").json()["best"]
    return out


def may_be_best(api: TestClient, sweep_id: int) -> dict[int, bool]:
    trials = api.get(f"{API}/sweeps/{sweep_id}/trials").json()["trials"]
    return {t["job_id"]: t["may_be_best"] for t in trials}


def test_a_failed_or_cancelled_trial_is_never_best(api: TestClient, db: Database) -> None:
    sweep = api.post(f"{API}/sweeps", json=SWEEP).json()
    ids = [t["job_id"] for t in api.get(f"{API}/sweeps/{sweep['id']}/trials").json()["trials"]]
    drive(db, ids[0], JobState.RUNNING, loss=0.01)
    drive(db, ids[0], JobState.FAILED)
    drive(db, ids[1], JobState.RUNNING, loss=0.02)
    drive(db, ids[1], JobState.CANCELLED)
    drive(db, ids[2], JobState.RUNNING, loss=0.4)
    drive(db, ids[3], JobState.RUNNING, loss=0.5)
    drive(db, ids[3], JobState.SUCCEEDED)
    now = best(api, sweep["id"])
    assert now is not None and now["job_id"] == ids[2] and now["outcome"] == "running"
    # Each trial says whether it competes, by the same rule (the page and the CLI rank by it).
    assert may_be_best(api, sweep["id"]) == {
        ids[0]: False,
        ids[1]: False,
        ids[2]: True,
        ids[3]: True,
    }
    drive(db, ids[2], JobState.FAILED)
    now = best(api, sweep["id"])
    assert now is not None and now["job_id"] == ids[3] and now["outcome"] == "succeeded"
    assert now["value"] == 0.5
    assert may_be_best(api, sweep["id"])[ids[2]] is False


def test_a_cancelled_sweep_finishes_when_its_last_trial_ends(api: TestClient, db: Database) -> None:
    sweep = api.post(f"{API}/sweeps", json=SWEEP).json()
    ids = [t["job_id"] for t in api.get(f"{API}/sweeps/{sweep['id']}/trials").json()["trials"]]
    drive(db, ids[0], JobState.RUNNING)
    r = api.post(f"{API}/sweeps/{sweep['id']}/cancel").json()
    assert r["state"] == "cancelled" and r["finished_at"] is None, "a trial is still running"
    with db.session() as s:
        assert has_running_sweeps(s)
        advance_sweeps(s)
    assert api.get(f"{API}/sweeps/{sweep['id']}").json()["finished_at"] is None
    drive(db, ids[0], JobState.CANCELLED)
    with db.session() as s:
        advance_sweeps(s)
    with db.session() as s:
        job = s.get(Job, ids[0])
        assert job is not None and job.finished_at is not None
        ended = job.finished_at
        assert not has_running_sweeps(s)
    body = api.get(f"{API}/sweeps/{sweep['id']}").json()
    assert body["state"] == "cancelled" and body["finished_at"] is not None
    assert body["finished_at"].startswith(ended.strftime("%Y-%m-%dT%H:%M:%S"))


def test_a_sweep_cancelled_with_nothing_started_finishes_at_once(api: TestClient) -> None:
    sweep = api.post(f"{API}/sweeps", json=SWEEP).json()
    r = api.post(f"{API}/sweeps/{sweep['id']}/cancel").json()
    assert r["state"] == "cancelled" and r["finished_at"] is not None
