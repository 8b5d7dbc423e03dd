"""Preemption on the real dev Slurm cluster: Slurm's warning signal, and a plain requeue.

Either way the job resumes from a checkpoint as attempt 2 of the same ddpq job, with one loss
point per step.
"""

from __future__ import annotations

import subprocess

import pytest
from sqlalchemy import func, select

from service.core.config import Settings
from service.core.states import JobState
from service.store.db import Database
from service.store.jobs import crud as jobs
from service.store.models import Checkpoint, Metric
from tests.slurm.conftest import (
    SlurmDb,
    count_losses,
    job_row,
    loss_steps,
    running_worker,
    submit,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.slurm

MAX_STEPS = 60
SPEC = {
    "task": "regression",
    "backend": "gloo",
    "resources": {"nnodes": 1, "nproc_per_node": 2, "timeout_min": 10},
    "training": {"max_steps": MAX_STEPS, "batch_size": 16, "checkpoint_every_steps": 10},
    "config": {"num_samples": 4096, "sleep_per_step_ms": 150},
}


def _first_step_of_attempt(db: Database, job_id: int, attempt: int) -> int | None:
    with db.session(write=False) as s:
        return s.scalar(
            select(func.min(Metric.step)).where(
                Metric.job_id == job_id, Metric.name == "loss", Metric.attempt == attempt
            )
        )


def _newest_checkpoint_step(db: Database, job_id: int, attempt: int) -> int | None:
    with db.session(write=False) as s:
        return s.scalar(
            select(func.max(Checkpoint.step)).where(
                Checkpoint.job_id == job_id, Checkpoint.attempt == attempt
            )
        )


def _run_and_interrupt(db: Database, settings: Settings, interrupt: list[str]) -> int:
    """Start the job, wait for a periodic checkpoint, run ``interrupt`` + the Slurm job id,
    and wait for the job to end. Returns the job id."""
    job_id = submit(db, settings, SPEC)
    with running_worker(settings):
        wait_until(lambda: count_losses(db, job_id) >= 12, 120, "losses past step 10")
        first_slurm_id = job_row(db, job_id).scheduler_job_id
        assert first_slurm_id
        subprocess.run([*interrupt, first_slurm_id], check=True, timeout=20)
        wait_until(lambda: job_row(db, job_id).attempt == 2, 60, "the relaunch (attempt 2)")
        state = wait_until(
            lambda: (s := JobState(job_row(db, job_id).state)).is_terminal and s,
            180,
            "the relaunched job to finish",
        )
    job = job_row(db, job_id)
    assert state == JobState.SUCCEEDED, job.error
    assert job.attempt == 2 and job.restarts == 0
    assert job.scheduler_job_id and job.scheduler_job_id != first_slurm_id
    with db.session(write=False) as s:
        reasons = [e.reason or "" for e in jobs.list_events(s, job_id) if e.to_state == "queued"]
    assert any(r.startswith("preempted") for r in reasons), reasons
    assert loss_steps(db, job_id) == list(range(1, MAX_STEPS + 1))
    return job_id


def test_warning_signal_checkpoints_and_resumes_as_attempt_2(
    slurm_db: SlurmDb,
) -> None:
    settings, db = slurm_db
    job_id = _run_and_interrupt(db, settings, ["scancel", "--signal=USR1"])
    resumed_at = _first_step_of_attempt(db, job_id, 2)
    # Resumed after a checkpoint, not from step 1.
    assert resumed_at is not None and resumed_at > 10, resumed_at


def test_plain_requeue_resumes_from_the_newest_periodic_checkpoint(
    slurm_db: SlurmDb,
) -> None:
    settings, db = slurm_db
    job_id = _run_and_interrupt(db, settings, ["scontrol", "requeue"])
    resumed_at = _first_step_of_attempt(db, job_id, 2)
    newest = _newest_checkpoint_step(db, job_id, 1)
    # Attempt 2 trains on from the newest checkpoint attempt 1 recorded: not from step 1, not
    # from an older one (checkpoints every 10 steps; the requeue came after step 12).
    assert newest is not None and newest >= 10, newest
    assert resumed_at == newest + 1, (resumed_at, newest)
