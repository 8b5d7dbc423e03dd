"""The sweep resource over the real app on SQLite and PostgreSQL: submit, trials, 422s that
store nothing, extend, retry-failed, cancel, max_failed, and who may touch a sweep."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from service.app import create_app
from service.core.config import Settings
from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.store.attempts.tokens import mint_attempt_token
from service.store.auth.tokens import create_token
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs import crud as jobs
from service.store.models import Job, JobEvent, Sweep, SweepTrial
from service.store.reaper import reap_once
from service.store.workers import registry as workers

API = API_PREFIX
BASE: dict[str, Any] = {"name": "b", "task": "regression", "training": {"max_steps": 5}}
SWEEP: dict[str, Any] = {
    "name": "grid",
    "base": BASE,
    "axes": {"training.lr": {"grid": [0.001, 0.01]}, "config.hidden": {"grid": [8, 16]}},
    "seeds": 2,
    "max_concurrent": 2,
}


def counts(db: Database) -> tuple[int, int, int]:
    with db.session(write=False) as s:
        return tuple(  # type: ignore[return-value]
            s.scalar(select(func.count()).select_from(t)) or 0 for t in (Sweep, SweepTrial, Job)
        )


def post_sweep(api: TestClient, body: dict[str, Any] | None = None, **h: Any) -> dict[str, Any]:
    r = api.post(f"{API}/sweeps", json=body or SWEEP, **h)
    assert r.status_code == 201, r.text
    out: dict[str, Any] = r.json()
    return out


def trials(api: TestClient, sweep_id: int, **h: Any) -> list[dict[str, Any]]:
    r = api.get(f"{API}/sweeps/{sweep_id}/trials", **h)
    assert r.status_code == 200, r.text
    rows: list[dict[str, Any]] = r.json()["trials"]
    return rows


def run_job(db: Database, job_id: int, end: JobState, loss: float | None = None) -> None:
    """Drive one job queued → starting → running → ``end`` through the store."""
    with db.session() as s:
        workers.register_worker(
            s, worker_id="w", host="h", pid=1, launcher="local", capacity={"slots": 100}
        )
        job = s.get(Job, job_id)
        assert job is not None
        jobs.apply_transition(s, jobs.Transition(job_id, JobState.QUEUED, JobState.STARTING))
        jobs.apply_transition(s, jobs.Transition(job_id, JobState.STARTING, JobState.RUNNING))
        if loss is not None:
            job.latest_metrics = {"loss": {"value": loss, "step": 5}}
        jobs.apply_transition(s, jobs.Transition(job_id, JobState.RUNNING, end, "test"))


def test_submit_expands_every_trial_into_a_queued_job(api: TestClient, db: Database) -> None:
    sweep = post_sweep(api)
    assert sweep["state"] == "running" and sweep["trials_total"] == 8
    assert sweep["counts"]["queued"] == 8 and sweep["objective"]["metric"] == "loss"
    rows = trials(api, sweep["id"])
    assert [r["overrides"] for r in rows[:2]] == [
        {"training.lr": 0.001, "config.hidden": 8, "training.seed": 0},
        {"training.lr": 0.001, "config.hidden": 8, "training.seed": 1},
    ]
    job = api.get(f"{API}/jobs/{rows[3]['job_id']}").json()
    assert job["sweep_id"] == sweep["id"] and job["trial_key"] == rows[3]["key"]
    assert job["spec"]["training"]["lr"] == 0.001 and job["spec"]["config"]["hidden"] == 16
    assert job["spec"]["training"]["seed"] == 1 and job["name"] == "grid-3"
    events = api.get(f"{API}/jobs/{job['id']}/events").json()["events"]
    assert [e["to_state"] for e in events] == ["queued"]
    csv = api.get(f"{API}/sweeps/{sweep['id']}/trials", params={"format": "csv"}).text
    assert csv.splitlines()[0].endswith("config.hidden,training.lr,training.seed")
    assert len(csv.splitlines()) == 9
    listed = api.get(f"{API}/sweeps").json()["sweeps"]
    assert [s["id"] for s in listed] == [sweep["id"]]


@pytest.mark.parametrize(
    ("axes", "loc"),
    [
        # A path no spec has is the axis's error (once), a bad value the trial's.
        ({"training.lrr": {"grid": [0.1]}}, ["body", "axes", "training.lrr"]),
        ({"training.lr": {"grid": [0.1, -1]}}, ["body", "trials", 1, "training.lr"]),
        ({"name.first": {"grid": [1]}}, ["body", "axes", "name.first"]),
        ({"training..lr": {"grid": [1]}}, ["body", "axes", "training..lr"]),
    ],
)
def test_a_bad_axis_or_one_bad_trial_is_422_and_stores_nothing(
    api: TestClient, db: Database, axes: dict[str, Any], loc: list[Any]
) -> None:
    r = api.post(f"{API}/sweeps", json={**SWEEP, "axes": axes, "seeds": 1})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert detail[0]["loc"] == loc, detail
    if loc[1] == "trials":
        assert detail[0]["msg"].startswith(f"trial {loc[2]} (")
    assert counts(db) == (0, 0, 0), "nothing stored"


def test_extend_adds_only_new_keys(api: TestClient, db: Database) -> None:
    sweep = post_sweep(api)
    before = {r["key"] for r in trials(api, sweep["id"])}
    r = api.post(
        f"{API}/sweeps/{sweep['id']}/extend", json={"axes": {"training.lr": {"grid": [0.01, 0.1]}}}
    )
    assert r.status_code == 200, r.text
    assert r.json()["added"] == 4 and r.json()["trials_total"] == 12
    after = trials(api, sweep["id"])
    added = [t for t in after if t["key"] not in before]
    assert {t["overrides"]["training.lr"] for t in added} == {0.1}
    assert [t["position"] for t in added] == [8, 9, 10, 11]
    again = api.post(
        f"{API}/sweeps/{sweep['id']}/extend", json={"axes": {"training.lr": {"grid": [0.1]}}}
    )
    assert again.json()["added"] == 0, "extending with known values adds nothing"
    bad = api.post(f"{API}/sweeps/{sweep['id']}/extend", json={"axes": {"x.y": {"grid": [1]}}})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "axes", "x.y"]


def test_retry_failed_reruns_exactly_the_failed_trials(api: TestClient, db: Database) -> None:
    sweep = post_sweep(api)
    rows = trials(api, sweep["id"])
    for i, row in enumerate(rows):
        end = JobState.FAILED if i in (2, 5) else JobState.SUCCEEDED
        run_job(db, row["job_id"], end, loss=1.0 + i)
    reap_once(db)
    assert api.get(f"{API}/sweeps/{sweep['id']}").json()["state"] == "succeeded"
    r = api.post(f"{API}/sweeps/{sweep['id']}/retry-failed")
    assert r.status_code == 200, r.text
    assert r.json()["added"] == 2 and r.json()["state"] == "running"
    after = trials(api, sweep["id"])
    changed = [
        i for i, (a, b) in enumerate(zip(rows, after, strict=True)) if a["job_id"] != b["job_id"]
    ]
    assert changed == [2, 5], "only the failed trials got a new job"
    assert [after[i]["attempts"] for i in changed] == [2, 2]
    assert all(after[i]["state"] == "queued" for i in changed)
    assert after[2]["key"] == rows[2]["key"]
    old = api.get(f"{API}/jobs/{rows[2]['job_id']}").json()
    assert old["state"] == "failed", "the failed job stays failed (terminal states never change)"
    new = api.get(f"{API}/jobs/{after[2]['job_id']}").json()
    assert new["spec"] == old["spec"] and new["trial_key"] == old["trial_key"]
    assert api.post(f"{API}/sweeps/{sweep['id']}/retry-failed").json()["added"] == 0


def test_max_failed_stops_the_sweep_and_cancels_the_rest(api: TestClient, db: Database) -> None:
    sweep = post_sweep(api, {**SWEEP, "max_failed": 2})
    rows = trials(api, sweep["id"])
    run_job(db, rows[0]["job_id"], JobState.FAILED)
    with db.session() as s:  # one trial running when the sweep stops
        jobs.apply_transition(
            s, jobs.Transition(rows[2]["job_id"], JobState.QUEUED, JobState.STARTING)
        )
    reap_once(db)
    assert api.get(f"{API}/sweeps/{sweep['id']}").json()["stop_reason"] is None
    run_job(db, rows[1]["job_id"], JobState.FAILED)
    reap_once(db)
    body = api.get(f"{API}/sweeps/{sweep['id']}").json()
    assert "2 trial(s) failed (max_failed 2)" in body["stop_reason"]
    assert body["counts"]["cancelled"] == 5 and body["counts"]["starting"] == 1
    running = api.get(f"{API}/jobs/{rows[2]['job_id']}").json()
    assert running["cancel_requested"], "a started trial is asked to stop"
    reasons = [
        e["reason"] for e in api.get(f"{API}/jobs/{rows[3]['job_id']}/events").json()["events"]
    ]
    assert any("max_failed 2" in (r or "") for r in reasons), reasons
    with db.session() as s:
        jobs.apply_transition(
            s, jobs.Transition(rows[2]["job_id"], JobState.STARTING, JobState.CANCELLED)
        )
    reap_once(db)
    assert api.get(f"{API}/sweeps/{sweep['id']}").json()["state"] == "failed"


def test_cancel_ends_queued_trials_and_flags_started_ones(api: TestClient, db: Database) -> None:
    sweep = post_sweep(api)
    first = trials(api, sweep["id"])[0]["job_id"]
    with db.session() as s:
        workers.register_worker(
            s, worker_id="w", host="h", pid=1, launcher="local", capacity={"slots": 4}
        )
        claimed = claims.claim_next_job(
            s, worker_id="w", launcher="local", max_gpus_per_node=0, lease_s=30
        )
        assert claimed is not None and claimed.id == first
    r = api.post(f"{API}/sweeps/{sweep['id']}/cancel")
    assert r.status_code == 202, r.text
    assert r.json()["state"] == "cancelled"
    assert r.json()["counts"]["cancelled"] == 7 and r.json()["counts"]["starting"] == 1
    assert api.get(f"{API}/jobs/{first}").json()["cancel_requested"]
    assert api.post(f"{API}/sweeps/{sweep['id']}/cancel").status_code == 202, "idempotent"
    assert api.post(f"{API}/sweeps/{sweep['id']}/retry-failed").status_code == 409


def test_best_trial_follows_the_objective(api: TestClient, db: Database) -> None:
    sweep = post_sweep(api, {**SWEEP, "seeds": 1})
    rows = trials(api, sweep["id"])
    for row, loss in zip(rows, [0.5, 0.2, 0.9, 0.4], strict=True):
        run_job(db, row["job_id"], JobState.SUCCEEDED, loss=loss)
    body = api.get(f"{API}/sweeps/{sweep['id']}").json()
    assert body["best"]["job_id"] == rows[1]["job_id"] and body["best"]["value"] == 0.2
    values = [t["objective_value"] for t in trials(api, sweep["id"])]
    assert values == [0.5, 0.2, 0.9, 0.4]


def test_other_owners_get_404_and_attempt_tokens_401(settings: Settings, db: Database) -> None:
    with db.session() as s:
        alice = create_token(s, owner="alice")[1]
        bob = create_token(s, owner="bob")[1]
    auth = settings.model_copy(update={"auth": "on"})
    with TestClient(create_app(auth)) as api:
        mine = {"headers": {"Authorization": f"Bearer {alice}"}}
        theirs = {"headers": {"Authorization": f"Bearer {bob}"}}
        sweep = post_sweep(api, **mine)
        assert sweep["owner"] == "alice"
        sid = sweep["id"]
        job_id = trials(api, sid, **mine)[0]["job_id"]
        with db.session() as s:
            rank = {"headers": {"Authorization": f"Bearer {mint_attempt_token(s, job_id, 1)}"}}
        ext = {"axes": {"training.lr": {"grid": [0.5]}}}
        for method, path, body in [
            ("get", f"/sweeps/{sid}", None),
            ("get", f"/sweeps/{sid}/trials", None),
            ("post", f"/sweeps/{sid}/cancel", None),
            ("post", f"/sweeps/{sid}/retry-failed", None),
            ("post", f"/sweeps/{sid}/extend", ext),
        ]:
            r = api.request(method, API + path, json=body, **theirs)
            assert r.status_code == 404, f"bob {method} {path}: {r.status_code} {r.text}"
            r = api.request(method, API + path, json=body, **rank)
            assert r.status_code == 401, f"attempt token {method} {path}: {r.status_code}"
        assert api.get(f"{API}/sweeps", **theirs).json()["sweeps"] == []
        assert api.post(f"{API}/sweeps", json=SWEEP, **rank).status_code == 401
        assert api.get(f"{API}/sweeps/{sid}", **mine).json()["state"] == "running"
        assert trials(api, sid, **mine)[0]["attempts"] == 1, "bob's retry changed nothing"


def test_claim_holds_max_concurrent(api: TestClient, db: Database) -> None:
    sweep = post_sweep(api)
    plain = api.post(f"{API}/jobs", json=BASE).json()["id"]

    def claim() -> int | None:
        with db.session() as s:
            job = claims.claim_next_job(
                s, worker_id="w", launcher="local", max_gpus_per_node=0, lease_s=30
            )
            return job.id if job is not None else None

    with db.session() as s:
        workers.register_worker(
            s, worker_id="w", host="h", pid=1, launcher="local", capacity={"slots": 10}
        )
    got = [claim(), claim(), claim()]
    assert got[2] == plain, "the third claim skips the full sweep and takes the plain job"
    assert claim() is None
    with db.session(write=False) as s:
        assert not claims.count_claimable_jobs(s, launcher="local", max_gpus_per_node=0, limit=1)
    with db.session() as s:
        jobs.apply_transition(s, jobs.Transition(got[0], JobState.STARTING, JobState.SUCCEEDED))
        assert s.scalar(select(func.count()).where(JobEvent.job_id == got[0])) == 3
    with db.session(write=False) as s:
        assert claims.count_claimable_jobs(s, launcher="local", max_gpus_per_node=0, limit=1)
    assert claim() is not None and claim() is None
    assert sweep["max_concurrent"] == 2


@pytest.mark.parametrize(
    ("raw", "loc"),
    [
        (b'{"name": "s", "base": {"task": "regression"}, "axes": {"training.lr": {"grid": [NaN]}}}',
         ["body", "axes", "training.lr", "grid"]),
        (b'{"name": "s", "base": {"task": "regression"}, "axes": {"training.lr": {"pick": [1]}}}',
         ["body", "axes", "training.lr"]),
        (b'{"name": "s", "base": {"task": "regression"}, "samples": 3}', ["body", "samples"]),
        (b'{"name": "s"', ["body"]),
        (b"\xff\xfe", ["body"]),
    ],
)  # fmt: skip
def test_bodies_json_cannot_carry_are_422_not_500(
    api: TestClient, db: Database, raw: bytes, loc: list[Any]
) -> None:
    r = api.post(f"{API}/sweeps", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == loc, r.json()
    assert counts(db) == (0, 0, 0)
