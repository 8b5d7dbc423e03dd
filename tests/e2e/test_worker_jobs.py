"""Regression jobs through the real API, a real worker and real torchrun ranks (gloo, CPU):
two at once on one worker, a failing rank, and a cancel."""

from __future__ import annotations

import re
import time
from datetime import datetime
from typing import Any

import pytest
from sqlalchemy import func, select

from service.store.models import Metric


def _count_metrics(dep: Any, job_id: int) -> tuple[int, datetime | None]:
    with dep.db.session(write=False) as s:
        row = s.execute(
            select(func.count(), func.max(Metric.time)).where(Metric.job_id == job_id)
        ).one()
    return int(row[0]), row[1]


@pytest.mark.slow
@pytest.mark.parametrize("dep_fixture", ["deployment", "pg_deployment"])
def test_two_jobs_on_a_two_slot_worker_both_succeed(
    request: pytest.FixtureRequest, dep_fixture: str
) -> None:
    dep = request.getfixturevalue(dep_fixture)
    dep.start_worker(slots=2)
    spec = dep.load_example("regression", training={"epochs": 1})
    ids = [dep.submit({**spec, "name": f"pair-{i}"}) for i in range(2)]
    jobs = [dep.wait_state(job_id, ("succeeded",), 240) for job_id in ids]
    # They ran side by side (each with its own torchrun rendezvous port) ...
    starts = [datetime.fromisoformat(j["started_at"]) for j in jobs]
    ends = [datetime.fromisoformat(j["finished_at"]) for j in jobs]
    assert max(starts) < min(ends), f"the two jobs did not overlap: {starts} {ends}"
    for job in jobs:  # ... and each trained to the end on both ranks.
        assert job["attempt"] == 1 and job["error"] is None
        progress = job["progress"]
        assert progress["step"] == progress["total_steps"] > 0, progress
        assert dep.processes(job["id"]) == []


def test_failing_rank_fails_the_job_with_its_error(deployment: Any) -> None:
    dep = deployment
    dep.start_worker()
    spec = dep.load_example("regression", config={"fail_rank": 1, "fail_at_step": 5})
    job_id = dep.submit(spec)
    dep.wait_state(job_id, ("running", "failed"), 120)
    job = dep.wait_state(job_id, ("failed",), 120)  # a loaded box; speed: test_failures_told_fast
    error = job["error"]
    assert error.startswith("rank 1 failed: RuntimeError: injected failure on rank 1 at step 5"), (
        error
    )
    assert "Traceback" in error or "File " in error, f"no traceback tail in: {error}"
    assert dep.processes(job_id) == []
    assert job["attempt"] == 1


def test_failure_before_the_first_step_is_not_retried(deployment: Any) -> None:
    """An entrypoint that cannot be imported fails every attempt the same way: issue 6 says
    such errors are not retried, whatever max_restarts allows."""
    dep = deployment
    dep.start_worker()
    spec = dep.load_example("custom_loop", task="examples.no_such_module:train", max_restarts=2)
    job_id = dep.submit(spec)
    job = dep.wait_state(job_id, ("failed",), 180)
    assert re.match(
        r"setup: rank [01] failed before its first step: EntrypointError: cannot import "
        r"'examples\.no_such_module'",
        job["error"],
    ), job["error"]
    assert job["attempt"] == 1, job
    assert [e["to_state"] for e in dep.events(job_id)].count("queued") == 1, "never requeued"


def test_cancel_stops_a_running_job(deployment: Any) -> None:
    dep = deployment
    dep.start_worker()
    spec = dep.load_example(
        "regression", config={"sleep_per_step_ms": 100}, training={"epochs": 100}
    )
    job_id = dep.submit(spec)
    dep.wait_state(job_id, ("running",), 120)
    dep.wait_for(lambda: _count_metrics(dep, job_id)[0] > 0, 90, "the first metrics")
    r = dep.http.post(f"/jobs/{job_id}/cancel")
    assert r.status_code == 202, r.text
    t0 = time.monotonic()
    # Within seconds (SIGTERM, the ranks' stop at a step boundary); 30 s leaves a loaded
    # 2-core box room, and stays far below torchrun's own 30 s + SIGKILL path plus a lease.
    job = dep.wait_state(job_id, ("cancelled",), 30)
    assert time.monotonic() - t0 < 30
    assert dep.processes(job_id) == []
    count, last = _count_metrics(dep, job_id)
    finished = datetime.fromisoformat(job["finished_at"])
    assert last is not None and last <= finished, f"metric written at {last} after {finished}"
    time.sleep(2)
    assert _count_metrics(dep, job_id)[0] == count, "metrics were written after the cancel"
    assert dep.events(job_id)[-1]["reason"] == "cancel requested"


def test_a_cancelled_entrypoint_deaf_to_should_stop_keeps_every_point_it_reported(
    deployment: Any,
) -> None:
    """The entrypoint reports 300 steps, then stays in its own code and never calls
    ``should_stop()``: the cancel ends the rank through its stop grace, mid-code, with most
    of those points still in its buffer. Every one is stored all the same (rank 0 hands its
    buffer to the writer and lets it drain before it exits)."""
    dep = deployment
    dep.start_worker()
    spec = dep.load_example("custom_loop", task="tests.e2e.deaf_loop:train", config={})
    spec["resources"] = {"nnodes": 1, "nproc_per_node": 1}
    job_id = dep.submit(spec)
    marker = dep.artifact_dir / "jobs" / str(job_id) / "attempt-1" / "reported"
    dep.wait_for(marker.exists, 120, "the entrypoint's reports")
    reported = int(marker.read_text())
    r = dep.http.post(f"/jobs/{job_id}/cancel")
    assert r.status_code == 202, r.text
    dep.wait_state(job_id, ("cancelled",), 60)
    with dep.db.session(write=False) as s:
        steps = s.scalars(
            select(Metric.step).where(Metric.job_id == job_id, Metric.name == "loss")
        ).all()
    assert sorted(steps) == list(range(1, reported + 1)), (
        f"{len(steps)} of {reported} reported steps stored"
    )
    rank_log = (marker.parent / "rank-0.log").read_text(errors="replace")
    assert "no step boundary within" in rank_log, rank_log[-2000:]
