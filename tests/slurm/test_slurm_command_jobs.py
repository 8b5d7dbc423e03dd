"""A command job (the user's own script, shipped as a workspace) on the dev Slurm cluster,
across 2 nodes: each node's rank fetches the workspace through the API with the attempt's
token (the worker writes none of its files), the script brings up its own process group."""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from service.client import DdpqClient
from service.core.states import JobState
from service.store.db import Database
from tests.slurm.conftest import SlurmDb, job_row, loss_steps, running_worker
from tests.waiting import wait_until

pytestmark = pytest.mark.slurm
TRAIN_DDPQ = Path(__file__).resolve().parents[2] / "examples" / "tutorial" / "train_ddpq.py"

SCRIPT = textwrap.dedent(
    """
    import os
    import socket

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    print(f"rank {rank} of {dist.get_world_size()} on {node}: sum {total.item():.0f}", flush=True)
    with open(f"wrote-by-rank-{rank}.txt", "w") as fh:
        fh.write(node)
    dist.destroy_process_group()
    """
)


def _finished(db: Database, job_id: int) -> JobState | None:
    state = JobState(job_row(db, job_id).state)
    return state if state.is_terminal else None


def test_a_command_job_runs_on_two_nodes_from_its_workspace(
    slurm_db: SlurmDb, tmp_path: Path
) -> None:
    settings, db = slurm_db
    work = tmp_path / "project"
    work.mkdir()
    (work / "two_nodes.py").write_text(SCRIPT)
    assert settings.api_url is not None
    client = DdpqClient(settings.api_url, token="")
    with running_worker(settings):
        job = client.run(
            ["two_nodes.py"], workdir=work, nnodes=2, nproc_per_node=1, launcher="slurm",
            overrides={"backend": "gloo", "resources.timeout_min": 10},
        )  # fmt: skip
        job_id = int(job["id"])
        state = wait_until(lambda: _finished(db, job_id), 180, "the 2-node command job")
    attempt_dir = settings.resolved_artifact_dir / "jobs" / str(job_id) / "attempt-1"
    logs = {r: (attempt_dir / f"rank-{r}.log").read_text(errors="replace") for r in (0, 1)}
    assert state == JobState.SUCCEEDED, f"{job_row(db, job_id).error}\n{logs}"
    for rank in (0, 1):
        assert f"rank {rank} of 2 on " in logs[rank] and "sum 3" in logs[rank], logs[rank]
    nodes = {(attempt_dir / "workspace" / f"wrote-by-rank-{r}.txt").read_text() for r in (0, 1)}
    assert len(nodes) == 2, f"one rank per node, got {nodes}"
    assert "workspace: 1 file," in logs[0] + logs[1], "a rank fetched it through the API"


STEPS_PER_EPOCH = 16  # examples/tutorial/train_ddpq.py: 2,048 samples / 2 ranks / 64


def test_a_requeued_script_with_ddpqs_calls_resumes_from_its_newest_checkpoint(
    slurm_db: SlurmDb, tmp_path: Path
) -> None:
    """``scontrol requeue`` of a command job whose script calls ``ddpq.should_stop``: the
    script saves and returns, ddpq requeues it (a preemption, not a success), attempt 2 on
    the 2 nodes loads the newest checkpoint through the API and every step's loss is stored
    once."""
    settings, db = slurm_db
    work = tmp_path / "project"
    work.mkdir()
    shutil.copy(TRAIN_DDPQ, work / "train_ddpq.py")
    assert settings.api_url is not None
    client = DdpqClient(settings.api_url, token="")
    epochs = 8
    with running_worker(settings):
        job = client.run(
            ["train_ddpq.py", "--epochs", str(epochs), "--epoch-sleep", "1"], workdir=work,
            nnodes=2, nproc_per_node=1, launcher="slurm",
            overrides={"backend": "gloo", "resources.timeout_min": 10},
        )  # fmt: skip
        job_id = int(job["id"])
        wait_until(lambda: len(client.checkpoints(job_id)) >= 2, 180, "two checkpoints")
        first_slurm_id = job_row(db, job_id).scheduler_job_id
        assert first_slurm_id
        subprocess.run(["scontrol", "requeue", first_slurm_id], check=True, timeout=20)
        wait_until(lambda: job_row(db, job_id).attempt == 2, 90, "the relaunch (attempt 2)")
        state = wait_until(lambda: _finished(db, job_id), 240, "the relaunched job to finish")
    row = job_row(db, job_id)
    attempt_dir = settings.resolved_artifact_dir / "jobs" / str(job_id)
    logs = "\n".join(
        p.read_text(errors="replace")[-3000:] for p in attempt_dir.glob("*/rank-*.log")
    )
    assert state == JobState.SUCCEEDED, f"{row.error}\n{logs}"
    assert (row.attempt, row.restarts) == (2, 0), "a preemption is not a failure"
    assert loss_steps(db, job_id) == list(range(1, epochs * STEPS_PER_EPOCH + 1)), logs
    resumed = (attempt_dir / "attempt-2" / "rank-0.log").read_text(errors="replace")
    assert "resuming at epoch" in resumed, resumed[-3000:]
