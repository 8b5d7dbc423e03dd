"""A resumed job's history told truthfully, with real processes on SQLite and PostgreSQL: a
2-rank job (3 epochs × 4 steps, a checkpoint at each epoch end) whose worker and ranks are
killed after step 7 resumes as attempt 2 from the step-4 checkpoint. Steps 1-12 are stored
exactly once, 5-12 from attempt 2; attempt 1's points of steps 5-7 are still there on
request; the goodput ledger counts them as attempt 1's lost work and adds up to the wall
time."""

from __future__ import annotations

import contextlib
import os
import signal
from datetime import datetime
from typing import Any

import pytest

# 256 samples over 2 ranks, 32 per batch: 4 steps per epoch. Each step sleeps longer than the
# sink's flush interval, so every step's point is written at the end of that step, and the
# test has a whole step (2.5 s) between "step 7 is stored" and the step-8 checkpoint.
SPEC_OVERRIDES: dict[str, Any] = {
    "config": {"num_samples": 256, "sleep_per_step_ms": 2500},
    "training": {"epochs": 3, "batch_size": 32, "checkpoint_every_epochs": 1, "log_every_steps": 1},
    "max_restarts": 2,
}


@pytest.fixture(params=["sqlite", "postgresql"])
def dep(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue("deployment" if request.param == "sqlite" else "pg_deployment")


def loss_points(dep: Any, job_id: int, **params: Any) -> list[dict[str, Any]]:
    r = dep.http.get(f"/jobs/{job_id}/metrics", params={"name": "loss", **params})
    assert r.status_code == 200, r.text
    points: list[dict[str, Any]] = r.json()["points"]
    return points


def kill_everything(dep: Any, worker: Any, job_id: int) -> None:
    """What a lost node looks like: the worker frozen first (it must not act on its ranks'
    deaths), then torchrun and every rank SIGKILLed (no SIGTERM: no final checkpoint), then
    the worker."""
    worker.signal(signal.SIGSTOP)
    for pid in dep.processes(job_id):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    worker.signal(signal.SIGKILL)
    worker.popen.wait(30)


@pytest.mark.slow
def test_a_resumed_attempt_replaces_the_steps_it_trains_again(dep: Any) -> None:
    first = dep.start_worker()
    spec = dep.load_example("regression", **SPEC_OVERRIDES)
    job_id = dep.submit(spec)
    dep.wait_state(job_id, ("running",), 120)
    dep.wait_for(
        lambda: loss_points(dep, job_id, after_step=6), 120, "step 7's loss to be stored", 0.05
    )
    kill_everything(dep, first, job_id)
    steps_of_1 = [p["step"] for p in loss_points(dep, job_id)]
    checkpoints = [c["step"] for c in dep.http.get(f"/jobs/{job_id}/checkpoints").json()[
        "checkpoints"
    ]]  # fmt: skip
    assert steps_of_1 == list(range(1, 8)), f"killed after step 7: {steps_of_1}"
    assert checkpoints == [4], f"the step-4 checkpoint only (the kill came late?): {checkpoints}"
    dep.wait_for(lambda: not dep.processes(job_id), 30, "no process of attempt 1")

    dep.start_worker()  # its reaper requeues the job once the lease expires (15 s)
    job = dep.wait_state(job_id, ("succeeded",), 300)
    assert job["attempt"] == 2, job

    points = loss_points(dep, job_id)
    assert [p["step"] for p in points] == list(range(1, 13)), dep.diagnostics(job_id)
    assert [p["attempt"] for p in points] == [1] * 4 + [2] * 8, points
    assert {(p["agg"], p.get("ranks")) for p in points} == {("mean", 2)}, points
    history = loss_points(dep, job_id, include_superseded="true")
    old = [(p["step"], p["attempt"]) for p in history if p["superseded"]]
    assert old == [(5, 1), (6, 1), (7, 1)], history
    assert all(p["superseded_by"] == 2 for p in history if p["superseded"])
    assert job["latest_metrics"]["loss"] == points[-1]["value"]

    ledger = dep.http.get(f"/jobs/{job_id}/goodput").json()
    one, two = ledger["attempts"]
    assert (one["lost_steps"], one["lost_steps_range"], one["superseded_by"]) == (3, [5, 7], 2)
    # Steps 5, 6 and 7 each slept 2.5 s between attempt 1's step-4 and step-7 points.
    assert one["lost_s"] >= 3 * 2.5, one
    assert one["outcome"] == "requeued: worker lost: lease expired", one
    assert (two["resume_step"], two["lost_steps"], two["outcome"]) == (4, 0, "succeeded")
    assert two["training_started_at"] is not None and two["restore_s"] > 0, two
    phases = ("queued", "starting", "restore", "productive", "checkpoint_stall", "lost",
              "in_progress", "teardown")  # fmt: skip
    for line in (one, two, ledger):
        assert sum(line[f"{p}_s"] for p in phases) == pytest.approx(line["wall_s"], abs=1e-3)
    wall_s = _seconds(job["finished_at"]) - _seconds(job["created_at"])
    assert ledger["wall_s"] == pytest.approx(wall_s, abs=1e-3), (ledger, job)
    assert 0 < ledger["goodput"] < 1 and ledger["checkpoint_interval"]["estimate"] is True


def _seconds(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
