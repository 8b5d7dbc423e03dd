"""A Slurm worker that dies (SIGKILL) or stops cleanly (SIGTERM) while its Slurm job runs: the
job keeps running and streaming, and a new worker process (``python -m worker.main --launcher
slurm``, i.e. ``run_worker``) adopts it by ``scheduler_job_id`` and sees it through to
``succeeded`` as attempt 1, with one loss row per step (no second copy, no relaunch)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.core.states import JobState
from service.store.jobs import crud as jobs
from service.store.models import Worker
from tests.slurm.conftest import (
    SlurmDb,
    count_losses,
    job_row,
    loss_steps,
    sacct_state,
    submit,
)
from tests.waiting import wait_until
from tests.workers import mint_worker_token

pytestmark = pytest.mark.slurm  # 30–55 s each

LEASE_S = 4.0
MAX_STEPS = 80
SPEC = {
    "task": "regression",
    "backend": "gloo",
    "resources": {"nnodes": 1, "nproc_per_node": 2, "timeout_min": 10},
    "training": {"max_steps": MAX_STEPS, "batch_size": 16, "checkpoint_every_steps": 20},
    "config": {"num_samples": 4096, "sleep_per_step_ms": 150},
}


class WorkerProcess:
    """``python -m worker.main --launcher slurm`` in its own session, output to a file."""

    def __init__(self, slurm_db: SlurmDb, log_path: Path) -> None:
        settings, _ = slurm_db
        env = {
            **{k: v for k, v in os.environ.items() if k != "DDPQ_DATABASE_URL"},
            "DDPQ_HOME": str(settings.home),
            "DDPQ_WORKER_TOKEN": mint_worker_token(settings.resolved_database_url),
            "DDPQ_API_URL": settings.resolved_api_url,  # the slurm_db fixture's API
            "DDPQ_ARTIFACT_DIR": str(settings.resolved_artifact_dir),
            "DDPQ_SLURM_ENABLED": "1",
            "DDPQ_HEARTBEAT_INTERVAL_S": "0.5",
            "DDPQ_LEASE_S": str(LEASE_S),
        }
        self.log_path = log_path
        with open(log_path, "wb") as log_file:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "worker.main", "--launcher", "slurm"],
                env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def kill(self) -> None:
        """SIGKILL the whole process group (no clean shutdown)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=20)

    def stop(self, timeout_s: float = 40) -> int:
        """SIGTERM (a clean shutdown); SIGKILL if it does not exit within ``timeout_s``."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                return self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.popen.wait()


@contextlib.contextmanager
def _cleanup(procs: list[WorkerProcess], handles: list[str]) -> Iterator[None]:
    """Whatever happens, stop the workers and leave no Slurm job behind."""
    try:
        yield
    finally:
        for proc in procs:
            if proc.popen.poll() is None:
                proc.kill()
        for handle in handles:
            subprocess.run(["scancel", handle], capture_output=True, timeout=20)


def _run_until_streaming(slurm_db: SlurmDb, first: WorkerProcess, job_id: int) -> str:
    """Wait for the job to run on Slurm and report losses; returns its Slurm job id."""
    _, db = slurm_db
    wait_until(
        lambda: count_losses(db, job_id) > 0 and job_row(db, job_id).state == "running",
        120,
        f"the job to run and report losses; worker log:\n{first.output()}",
    )
    handle = job_row(db, job_id).scheduler_job_id
    assert handle
    return handle


def _adopted_and_succeeded(
    slurm_db: SlurmDb, job_id: int, handle: str, second: WorkerProcess
) -> None:
    _, db = slurm_db
    state = wait_until(
        lambda: (s := JobState(job_row(db, job_id).state)).is_terminal and s,
        180,
        "the adopted job to end",
        every_s=0.5,
    )
    job = job_row(db, job_id)
    assert state == JobState.SUCCEEDED, (job.error, second.output())
    assert (job.attempt, job.restarts, job.scheduler_job_id) == (1, 0, handle), (
        "the job must finish as the same attempt on the same Slurm job, not be relaunched"
    )
    assert loss_steps(db, job_id) == list(range(1, MAX_STEPS + 1)), "one loss row per step"
    assert sacct_state(handle) == "COMPLETED"
    with db.session(write=False) as s:
        events = [(e.from_state, e.to_state, e.reason) for e in jobs.list_events(s, job_id)]
    # State changes only: notes (from_state == to_state: retention, pending reasons) may come.
    changes = [to for frm, to, _ in events if frm != to]
    assert changes == ["queued", "starting", "running", "succeeded"], events
    assert f"adopted Slurm job {handle}" in second.output(), second.output()


def test_killed_worker_job_keeps_running_and_is_adopted(slurm_db: SlurmDb, tmp_path: Path) -> None:
    settings, db = slurm_db
    job_id = submit(db, settings, SPEC)
    procs: list[WorkerProcess] = []
    handles: list[str] = []
    with _cleanup(procs, handles):
        procs.append(first := WorkerProcess(slurm_db, tmp_path / "worker-a.log"))
        handles.append(handle := _run_until_streaming(slurm_db, first, job_id))
        first.kill()
        losses_at_kill = count_losses(db, job_id)
        # The Slurm job is not the worker's child: it keeps running and streaming losses.
        wait_until(lambda: count_losses(db, job_id) > losses_at_kill, 60, "losses after the kill")
        assert sacct_state(handle) == "RUNNING"
        assert job_row(db, job_id).state == "running"
        procs.append(second := WorkerProcess(slurm_db, tmp_path / "worker-b.log"))
        _adopted_and_succeeded(slurm_db, job_id, handle, second)
        assert second.stop() == 0, second.output()


def test_stopped_worker_leaves_the_job_running_for_the_next_one(
    slurm_db: SlurmDb, tmp_path: Path
) -> None:
    settings, db = slurm_db
    job_id = submit(db, settings, SPEC)
    procs: list[WorkerProcess] = []
    handles: list[str] = []
    with _cleanup(procs, handles):
        procs.append(first := WorkerProcess(slurm_db, tmp_path / "worker-a.log"))
        handles.append(handle := _run_until_streaming(slurm_db, first, job_id))
        assert first.stop() == 0, first.output()
        # A clean stop neither cancels nor requeues the Slurm job; the worker is marked stopped.
        job = job_row(db, job_id)
        assert (job.state, job.attempt, job.scheduler_job_id) == ("running", 1, handle)
        assert sacct_state(handle) == "RUNNING"
        with db.session(write=False) as s:
            worker = s.get(Worker, str(job.worker_id))
            assert worker is not None and worker.stopped_at is not None
        losses_at_stop = count_losses(db, job_id)
        wait_until(lambda: count_losses(db, job_id) > losses_at_stop, 60, "losses after the stop")
        procs.append(second := WorkerProcess(slurm_db, tmp_path / "worker-b.log"))
        _adopted_and_succeeded(slurm_db, job_id, handle, second)
        assert second.stop() == 0, second.output()
