"""A worker stopped mid-job (SIGTERM) or killed (SIGKILL): a second worker resumes the job from
its newest checkpoint as attempt 2, it succeeds, and each step's loss is stored exactly once;
attempt 1's token (read from its ranks' environment) is refused (409) from the requeue on."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from service.core.wire import API_PREFIX
from service.core.wire import attempt as wire
from service.store.models import Metric
from worker.attempt import attempt_tags
from worker.processes import find_tagged_processes


def loss_steps(dep: Any, job_id: int) -> tuple[list[int], int | None]:
    """Every stored ``loss`` step of the job, sorted (a duplicate would show twice), and the
    first step attempt 2 wrote."""
    with dep.db.session(write=False) as s:
        steps = s.scalars(
            select(Metric.step).where(Metric.job_id == job_id, Metric.name == "loss")
        ).all()
        first_of_2 = s.scalar(
            select(func.min(Metric.step)).where(
                Metric.job_id == job_id, Metric.name == "loss", Metric.attempt == 2
            )
        )
    return sorted(steps), first_of_2


def attempt_token(dep: Any, job_id: int) -> str:
    """The attempt token in the environment of one of the job's live processes (as a rank
    holds it: the API stores only its hash)."""
    for pid in dep.processes(job_id):
        for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            name, _, value = entry.partition(b"=")
            if name == b"DDPQ_ATTEMPT_TOKEN":
                return value.decode()
    raise AssertionError(f"no process of job {job_id} holds an attempt token")


def assert_old_token_refused(dep: Any, job_id: int, token: str) -> None:
    """Attempt 1's token, once the job is requeued (attempt 2, before it even starts): 409
    "attempt superseded", and it stores nothing (the point would show as a duplicate or an
    extra step in ``assert_each_loss_once``)."""
    headers = {"Authorization": f"Bearer {token}"}
    batch = {"points": [["loss", 1, 0, 123.0, time.time()], ["loss", 10**6, 0, 1.0, time.time()]]}
    r = httpx.post(f"{dep.url}{API_PREFIX}{wire.METRICS_PATH}", json=batch, headers=headers)
    assert r.status_code == 409, f"attempt 1's token after the requeue: {r.status_code} {r.text}"
    assert r.json()["detail"].startswith(wire.ATTEMPT_SUPERSEDED), r.text
    r = httpx.get(f"{dep.url}{API_PREFIX}{wire.SELF_PATH}", headers=headers)
    assert r.status_code == 409, r.text


def assert_each_loss_once(dep: Any, job_id: int, job: dict[str, Any]) -> None:
    steps, first_of_2 = loss_steps(dep, job_id)
    assert first_of_2 is not None and first_of_2 > 1, "attempt 2 should resume, not restart"
    total = job["progress"]["total_steps"]
    missing = sorted(set(range(1, total + 1)) - set(steps))
    assert steps == list(range(1, total + 1)), (
        f"one loss row per step across attempts; missing {missing[:20]}, "
        f"{len(steps)} rows for {total} steps\n{dep.diagnostics(job_id)}"
    )


@pytest.mark.slow
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
    old_token = attempt_token(dep, job_id)
    first.signal(signal.SIGTERM)
    assert first.popen.wait(60) == 0, first.output()
    job = dep.job(job_id)
    assert (job["state"], job["attempt"]) == ("queued", 2), job
    assert dep.events(job_id)[-1]["reason"] == "worker stopped"
    assert dep.processes(job_id) == []
    assert_old_token_refused(dep, job_id, old_token)

    dep.start_worker()
    job = dep.wait_state(job_id, ("succeeded",), 240)
    assert job["attempt"] == 2
    assert_each_loss_once(dep, job_id, job)


@pytest.mark.slow
def test_killed_worker_takes_its_ranks_along_and_the_job_is_reaped(deployment: Any) -> None:
    """SIGKILL: no clean shutdown. torchrun gets SIGTERM (parent-death signal) and stops the
    ranks; once the lease expires another worker requeues the job and runs attempt 2, which
    resumes from the checkpoint: each step's loss exactly once, no process of attempt 1
    alive."""
    dep = deployment
    first = dep.start_worker()
    spec = dep.load_example(
        "regression",
        config={"sleep_per_step_ms": 100},
        training={"epochs": 3, "checkpoint_every_steps": 5},
    )
    job_id = dep.submit(spec)
    dep.wait_state(job_id, ("running",), 120)
    dep.wait_for(lambda: len(dep.processes(job_id)) >= 3, 60, "torchrun and 2 ranks")
    dep.wait_for(
        lambda: dep.http.get(f"/jobs/{job_id}/checkpoints").json()["checkpoints"],
        90,
        "a first checkpoint",
    )
    old_token = attempt_token(dep, job_id)
    first.signal(signal.SIGKILL)
    first.popen.wait(10)
    dep.wait_for(lambda: not dep.processes(job_id), 45, "the ranks to die with the worker")
    dep.start_worker()
    # The moment the new worker requeues it (attempt 2), attempt 1's token is refused.
    dep.wait_for(lambda: dep.job(job_id)["attempt"] == 2, 60, "the job to be requeued", 0.05)
    assert_old_token_refused(dep, job_id, old_token)
    job = dep.wait_state(job_id, ("succeeded",), 240)
    assert_old_token_refused(dep, job_id, old_token)
    assert job["attempt"] == 2
    reasons = [e["reason"] for e in dep.events(job_id)]
    assert "worker lost: lease expired" in reasons, reasons
    assert_each_loss_once(dep, job_id, job)
    attempt_1 = attempt_tags(job_id, 1, str(dep.artifact_dir))
    assert find_tagged_processes(attempt_1) == [], "a process of attempt 1 outlived it"
