"""Jobs through a real worker and the real dev Slurm cluster: success, streaming, multi-node,
cancel, and a request Slurm can never satisfy."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from service.core.states import JobState
from service.store import migrate
from service.store.db import Database
from service.store.jobs import crud as jobs
from service.store.models import Metric
from tests.slurm.conftest import (
    SlurmDb,
    assert_no_database_url,
    count_losses,
    job_row,
    loss_steps,
    running_worker,
    sacct_state,
    serving_api,
    slurm_settings,
    submit,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.slurm

REGRESSION = {
    "task": "regression",
    "backend": "gloo",
    "resources": {"nnodes": 1, "nproc_per_node": 2, "timeout_min": 10},
    "training": {"max_steps": 40, "batch_size": 16, "checkpoint_every_steps": 20},
    "config": {"num_samples": 2048, "sleep_per_step_ms": 100},
}


def _finished(db: Database, job_id: int) -> JobState | None:
    state = JobState(job_row(db, job_id).state)
    return state if state.is_terminal else None


def test_regression_one_node_two_ranks_on_postgresql(tmp_path: Path, pg_schema_url: str) -> None:
    settings = slurm_settings(tmp_path, pg_schema_url)
    db = Database.from_url(settings.resolved_database_url)
    migrate.upgrade(db.engine)
    try:
        job_id = submit(db, settings, REGRESSION)
        with serving_api(settings) as settings, running_worker(settings):
            wait_until(lambda: job_row(db, job_id).scheduler_job_id, 30, "a Slurm job id")
            # Losses arrive while the job still runs (streamed, not at the end).
            wait_until(
                lambda: (
                    count_losses(db, job_id) > 0 and job_row(db, job_id).state == JobState.RUNNING
                ),
                90,
                "losses while running",
            )
            state = wait_until(lambda: _finished(db, job_id), 120, "the job to finish")
        job = job_row(db, job_id)
        assert state == JobState.SUCCEEDED, job.error
        assert job.scheduler_job_id and job.scheduler_job_id.isdigit()
        assert loss_steps(db, job_id) == list(range(1, 41))
        assert sacct_state(job.scheduler_job_id) == "COMPLETED"
        assert_no_database_url(settings, job_id)
    finally:
        db.dispose()


def test_two_nodes_one_rank_each(slurm_db: SlurmDb, tmp_path: Path) -> None:
    settings, db = slurm_db
    spec = {**REGRESSION, "resources": {"nnodes": 2, "nproc_per_node": 1, "timeout_min": 10}}
    spec["config"] = {"num_samples": 512, "sleep_per_step_ms": 0}
    spec["training"] = {"max_steps": 12, "batch_size": 16}
    job_id = submit(db, settings, spec)
    with running_worker(settings):
        state = wait_until(lambda: _finished(db, job_id), 150, "the 2-node job to finish")
    job = job_row(db, job_id)
    assert state == JobState.SUCCEEDED, job.error
    assert loss_steps(db, job_id) == list(range(1, 13))
    # Both ranks ran, one on each node: each wrote its own log.
    attempt_dir = settings.resolved_artifact_dir / "jobs" / str(job_id) / "attempt-1"
    assert (attempt_dir / "rank-0.log").exists() and (attempt_dir / "rank-1.log").exists()


def test_cancel_a_running_job(slurm_db: SlurmDb) -> None:
    settings, db = slurm_db
    spec = {**REGRESSION, "training": {"max_steps": 2000, "batch_size": 16}}
    spec["config"] = {"num_samples": 100_000, "sleep_per_step_ms": 200}
    job_id = submit(db, settings, spec)
    with running_worker(settings):
        wait_until(lambda: count_losses(db, job_id) > 0, 90, "the job to report losses")
        scheduler_job_id = job_row(db, job_id).scheduler_job_id
        assert scheduler_job_id
        t0 = time.monotonic()
        with db.session() as s:
            jobs.cancel_job(s, job_id)
        state = wait_until(lambda: _finished(db, job_id), 15, "ddpq to show cancelled")
        elapsed = time.monotonic() - t0
    assert state == JobState.CANCELLED, job_row(db, job_id).error
    assert elapsed < 15
    assert wait_until(lambda: sacct_state(scheduler_job_id) == "CANCELLED", 10, "sacct CANCELLED")


def test_more_gpus_than_any_node_has_fails_with_a_clear_error(
    slurm_db: SlurmDb,
) -> None:
    settings, db = slurm_db
    spec = {**REGRESSION, "resources": {"nproc_per_node": 1, "gpus_per_node": 3}}
    job_id = submit(db, settings, spec)
    with running_worker(settings):
        state = wait_until(lambda: _finished(db, job_id), 30, "the job to fail")
    job = job_row(db, job_id)
    assert state == JobState.FAILED
    assert "sbatch refused the job" in (job.error or ""), job.error
    assert "gpus_per_node=3" in (job.error or "") and "gpu:2" in (job.error or ""), job.error


@pytest.mark.slow
def test_digits_reaches_95_percent(slurm_db: SlurmDb) -> None:
    settings, db = slurm_db
    spec = {
        "task": "digits",
        "backend": "gloo",
        "resources": {"nnodes": 1, "nproc_per_node": 2, "timeout_min": 15},
        "training": {"epochs": 10, "batch_size": 32, "lr": 0.001, "optimizer": "adamw"},
    }
    job_id = submit(db, settings, spec)
    with running_worker(settings):
        state = wait_until(lambda: _finished(db, job_id), 300, "digits to finish")
    assert state == JobState.SUCCEEDED, job_row(db, job_id).error
    with db.session(write=False) as s:
        accuracy = (
            s.query(Metric.value)
            .filter(Metric.job_id == job_id, Metric.name == "eval_accuracy")
            .order_by(Metric.step.desc())
            .limit(1)
            .scalar()
        )
    assert accuracy is not None and accuracy >= 0.95, accuracy
