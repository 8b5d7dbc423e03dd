"""A worker stopped mid-job (SIGTERM) requeues the job; a second worker resumes it from its
newest checkpoint as attempt 2 and it succeeds."""

from __future__ import annotations

import signal
from typing import Any

import pytest
from sqlalchemy import func, select

from service.models import Metric


@pytest.mark.slow
@pytest.mark.xfail(
    strict=False,
    reason="known bug (issue 6): on a worker SIGTERM the losses between the last periodic "
    "flush and the stop step (e.g. steps 3-5) are sometimes never written, while the stop "
    "checkpoint is; seen once in two clean CI runs",
)
def test_stopped_worker_requeues_and_another_resumes(deployment: Any) -> None:
    dep = deployment
    first = dep.start_worker()
    spec = dep.load_example(
        "regression",
        config={"sleep_per_step_ms": 150},
        training={"epochs": 4, "checkpoint_every_steps": 5, "keep_checkpoints": 2},
    )
    job_id = dep.submit(spec)
    dep.wait_state(job_id, ("running",), 120)
    dep.wait_for(
        lambda: dep.http.get(f"/jobs/{job_id}/checkpoints").json()["checkpoints"],
        90,
        "a first checkpoint",
    )
    first.signal(signal.SIGTERM)
    assert first.popen.wait(60) == 0, first.output()
    job = dep.job(job_id)
    assert (job["state"], job["attempt"]) == ("queued", 2), job
    assert dep.events(job_id)[-1]["reason"] == "worker stopped"
    assert dep.processes(job_id) == []

    dep.start_worker()
    job = dep.wait_state(job_id, ("succeeded",), 240)
    assert job["attempt"] == 2
    with dep.db.session(write=False) as s:
        first_step = s.scalar(
            select(func.min(Metric.step)).where(
                Metric.job_id == job_id, Metric.name == "loss", Metric.attempt == 2
            )
        )
        steps = s.scalars(
            select(Metric.step).where(Metric.job_id == job_id, Metric.name == "loss")
        ).all()
    assert first_step is not None and first_step > 1, "attempt 2 should resume, not restart"
    total = job["progress"]["total_steps"]
    assert sorted(steps) == list(range(1, total + 1)), "one loss row per step across attempts"


@pytest.mark.slow
def test_killed_worker_takes_its_ranks_along_and_the_job_is_reaped(deployment: Any) -> None:
    """SIGKILL: no clean shutdown. torchrun gets SIGTERM (parent-death signal) and stops the
    ranks; once the lease expires another worker requeues the job and runs attempt 2."""
    dep = deployment
    first = dep.start_worker()
    spec = dep.load_example("regression", config={"sleep_per_step_ms": 100}, training={"epochs": 3})
    job_id = dep.submit(spec)
    dep.wait_state(job_id, ("running",), 120)
    dep.wait_for(lambda: len(dep.processes(job_id)) >= 3, 60, "torchrun and 2 ranks")
    first.signal(signal.SIGKILL)
    first.popen.wait(10)
    dep.wait_for(lambda: not dep.processes(job_id), 45, "the ranks to die with the worker")
    dep.start_worker()
    job = dep.wait_state(job_id, ("succeeded",), 240)
    assert job["attempt"] == 2
    reasons = [e["reason"] for e in dep.events(job_id)]
    assert "worker lost: lease expired" in reasons, reasons
