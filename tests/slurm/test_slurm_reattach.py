"""A worker killed while its Slurm job runs: the job keeps running and streaming, and a new
worker adopts it by ``scheduler_job_id`` and sees it through to ``succeeded`` (no relaunch)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from service import jobs
from service.states import JobState
from service.workers import register_worker
from tests.slurm.conftest import (
    SlurmDb,
    count_losses,
    job_row,
    loss_steps,
    sacct_state,
    submit,
    wait_until,
)
from worker.decisions import HeldRun, decide_on_status
from worker.launchers.base import RunPhase
from worker.launchers.slurm import SlurmLauncher
from worker.launchers.slurm_attach import adopt_slurm_jobs

pytestmark = pytest.mark.slurm

LEASE_S = 4.0
SPEC = {
    "task": "regression",
    "backend": "gloo",
    "resources": {"nnodes": 1, "nproc_per_node": 2, "timeout_min": 10},
    "training": {"max_steps": 80, "batch_size": 16, "checkpoint_every_steps": 20},
    "config": {"num_samples": 4096, "sleep_per_step_ms": 150},
}


def _start_worker_process(slurm_db: SlurmDb, log_path: Path) -> subprocess.Popen[bytes]:
    settings, _ = slurm_db
    env = {
        **os.environ,
        "DDPQ_HOME": str(settings.home),
        "DDPQ_DATABASE_URL": settings.resolved_database_url,
        "DDPQ_ARTIFACT_DIR": str(settings.resolved_artifact_dir),
        "DDPQ_SLURM_ENABLED": "1",
        "DDPQ_HEARTBEAT_INTERVAL_S": "0.5",
        "DDPQ_LEASE_S": str(LEASE_S),
    }
    with open(log_path, "wb") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "worker.main", "--launcher", "slurm"],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def test_killed_worker_job_keeps_running_and_is_adopted(slurm_db: SlurmDb, tmp_path: Path) -> None:
    settings, db = slurm_db
    job_id = submit(db, settings, SPEC)
    worker = _start_worker_process(slurm_db, tmp_path / "worker-a.log")
    try:
        wait_until(
            lambda: count_losses(db, job_id) > 0 and job_row(db, job_id).state == "running",
            120,
            "the job to run and report losses",
        )
        handle = job_row(db, job_id).scheduler_job_id
        assert handle
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=20)
    losses_at_kill = count_losses(db, job_id)
    # The Slurm job is not the worker's child: it keeps running and streaming losses.
    wait_until(lambda: count_losses(db, job_id) > losses_at_kill, 60, "losses after the kill")
    assert sacct_state(handle) == "RUNNING"

    with db.session() as s:
        register_worker(s, worker_id="b", host="h", pid=2, launcher="slurm", capacity={})
    time.sleep(LEASE_S + 0.5)
    with db.session() as s:
        adopted = adopt_slurm_jobs(s, worker_id="b", lease_s=60)
    assert [(a.job_id, a.scheduler_job_id, a.attempt) for a in adopted] == [(job_id, handle, 1)]

    # A fresh launcher (as in a restarted worker) follows the job by its handle alone.
    launcher = SlurmLauncher(settings)
    status = wait_until(
        lambda: (
            (st := launcher.poll(handle)).phase not in (RunPhase.PENDING, RunPhase.RUNNING) and st
        ),
        180,
        "the adopted job to end",
        interval_s=0.5,
    )
    run = HeldRun(job_id=job_id, attempt=1, state=JobState.RUNNING)
    decision = decide_on_status(run, status)
    assert decision is not None
    with db.session() as s:
        jobs.apply_transition(s, decision.transition, worker_id="b", error=decision.error)
    job = job_row(db, job_id)
    assert job.state == JobState.SUCCEEDED, (status, job.error)
    assert job.attempt == 1 and job.scheduler_job_id == handle
    assert loss_steps(db, job_id) == list(range(1, 81))
    assert sacct_state(handle) == "COMPLETED"
