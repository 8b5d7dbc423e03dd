"""Warm ranks (``worker.runtime.agent``) leave as soon as they are done, whatever the user's
entrypoint left running: a rank that returned with a non-daemon thread still alive must not
hold its attempt open until the launcher's teardown grace (30 s) kills it, as it did when
multiprocessing's exit joined that thread."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from service.core.config import Settings

ENTRYPOINT = "agenttest_threads:train"
# A user entrypoint importable only from the worker's PYTHONPATH (written by the test).
MODULE = textwrap.dedent(
    """
    import os
    import threading
    import time

    import torch


    def train(ctx):
        # Forgotten by the user: keeps a plain interpreter from exiting.
        threading.Thread(target=time.sleep, args=(3600,), name="left-behind").start()
        model = ctx.wrap_model(torch.nn.Linear(2, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(1, 4):
            loss = model(torch.ones(4, 2)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ctx.report(step, 0, loss=ctx.all_reduce_mean(loss.detach()))
        return {
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "threads": torch.get_num_threads(),
        }
    """
)
TEARDOWN_KILL = "teardown hangs after result.json"


def _conftest() -> ModuleType:
    """tests/e2e/conftest.py as a module (importlib mode: it cannot be imported by name)."""
    spec = importlib.util.spec_from_file_location(
        "_agent_e2e_conftest", Path(__file__).with_name("conftest.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


E2E = _conftest()


@pytest.fixture
def dep(tmp_path: Path) -> Iterator[Any]:
    """A SQLite deployment that allows this test's entrypoint."""
    settings = Settings(
        home=tmp_path / ".ddpq",
        database_url=f"sqlite:///{tmp_path / 'ddpq.db'}",
        artifact_dir=tmp_path / "artifacts",
        port=E2E.free_port(),
        heartbeat_interval_s=0.3,
        lease_s=15,
        allowed_entrypoints=["agenttest_*:*"],
    )
    deployment = E2E.Deployment(settings, tmp_path)
    try:
        yield deployment
    finally:
        deployment.close()
    E2E.wait_for(
        lambda: not E2E.tagged_processes(deployment.artifact_dir), 30, "no process to be left"
    )


def _start_worker(dep: Any, pythonpath: Path) -> Any:
    """A 1-slot worker whose ranks find user modules on ``pythonpath`` only."""
    argv = [sys.executable, "-m", "worker.main", "--slots", "1", "--gpus", "none"]
    proc = E2E.Proc.__new__(E2E.Proc)
    proc.name, proc.log_path = "worker", dep.tmp_path / "worker.log"
    proc._log = open(proc.log_path, "ab")  # noqa: SIM115 - closed by Proc.stop
    proc.popen = subprocess.Popen(
        argv, env={**dep.worker_env(), "PYTHONPATH": str(pythonpath)}, cwd=E2E.REPO,
        stdout=proc._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    dep.procs.append(proc)
    return proc


@pytest.mark.slow
def test_rank_leaving_a_thread_behind_exits_at_once(dep: Any, tmp_path: Path) -> None:
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "agenttest_threads.py").write_text(MODULE)
    worker = _start_worker(dep, mods)
    job_id = dep.submit(
        {
            "name": "threads-left",
            "task": ENTRYPOINT,
            "resources": {"nproc_per_node": 2, "cpus_per_task": 2, "timeout_min": 5},
            "training": {"epochs": 1, "batch_size": 4},
        }
    )
    job = dep.wait_state(job_id, ("succeeded",), 150)
    assert job["attempt"] == 1, job
    assert TEARDOWN_KILL not in worker.output(), (
        "a rank that returned kept its attempt alive until the launcher killed it\n"
        + dep.diagnostics(job_id)
    )
    result_path = dep.artifact_dir / "jobs" / str(job_id) / "attempt-1" / "result.json"
    extra = json.loads(result_path.read_text())["final_metrics"]
    assert (extra["omp"], extra["cuda"], extra["threads"]) == ("2", "", 2), extra
    assert dep.processes(job_id) == []
