"""A command job (the user's own script, shipped as a workspace) on the dev Slurm cluster,
across 2 nodes: each node's rank fetches the workspace through the API with the attempt's
token (the worker writes none of its files), the script brings up its own process group."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from service.client import DdpqClient
from service.core.states import JobState
from service.store.db import Database
from tests.slurm.conftest import SlurmDb, job_row, running_worker
from tests.waiting import wait_until

pytestmark = pytest.mark.slurm

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
