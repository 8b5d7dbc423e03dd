"""Stall detection and the non-finite loss policy with real torchrun ranks (gloo, CPU): a hung
rank fails the job ``stalled`` through a real worker; NaN losses on one rank or on all of them
fail the job or skip the step on every rank alike, and never hang; a custom entrypoint whose
reported loss goes NaN fails the job ``nonfinite_loss`` like a built-in task. The non-finite
tests start torchrun as the local launcher does: the attempt's spec file, the real attempt API
on loopback and a freshly minted attempt token, and no database URL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from service.core import artifacts
from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.store.checkpoints.crud import list_checkpoints
from service.store.db import Database
from service.store.jobs.claims import claim_next_job
from service.store.jobs.crud import Transition, apply_transition, submit_job
from service.store.metrics.points import query_points
from service.store.workers.registry import register_worker
from tests.rank_api import live_api, prepare_attempt
from worker import attempt as contract

REPO = Path(__file__).resolve().parents[2]
STALL_TIMEOUT_S = 10
# 1024 samples / 2 ranks / 32 per batch.
STEPS = 16


def regression(config: dict[str, Any], **training: Any) -> dict[str, Any]:
    return {
        "name": "faults",
        "task": "regression",
        "resources": {"nproc_per_node": 2},
        "config": {"num_samples": 1024, **config},
        "training": {"epochs": 1, "batch_size": 32, **training},
    }


# -- stall: through the API and a real worker --------------------------------------------------


@pytest.mark.slow
def test_hung_rank_fails_the_job_stalled_with_stacks_in_the_logs(deployment: Any) -> None:
    dep = deployment
    dep.start_worker()
    spec = regression(
        {"hang_rank": 1, "hang_at_step": 3}, epochs=5, stall_timeout_s=STALL_TIMEOUT_S
    )
    job_id = dep.submit(spec)
    job = dep.wait_state(job_id, ("running",), 120)
    rank1_log = artifacts.rank_log_path(dep.artifact_dir, job_id, 1, 1)
    dep.wait_for(
        lambda: rank1_log.exists() and "injected hang" in rank1_log.read_text(),
        120,
        "rank 1 to hang",
    )
    hung_s = time.monotonic()
    job = dep.wait_state(job_id, ("failed",), STALL_TIMEOUT_S + 60)
    took_s = time.monotonic() - hung_s
    assert took_s < STALL_TIMEOUT_S + 30, f"failed {took_s:.0f} s after the hang"

    error = job["error"]
    assert error.startswith("stalled: rank 1 finished no step for "), error
    assert "after step 2" in error and "stall_timeout_s=10" in error, error
    assert "before_step" in error, f"the error shows where rank 1 was stuck: {error}"
    failed = [e for e in dep.events(job_id) if e["to_state"] == "failed"]
    assert failed and failed[0]["reason"].startswith("stalled: rank 1"), failed
    # Each rank dumped the Python stacks of all its threads into its own log.
    rank1 = rank1_log.read_text()
    assert "Python stacks of every thread follow" in rank1
    assert "ddpq-stall-watchdog" in rank1 or "Thread 0x" in rank1, rank1[-3000:]
    assert "in before_step" in rank1, "rank 1's stack shows the hang"
    rank0 = artifacts.rank_log_path(dep.artifact_dir, job_id, 1, 0).read_text()
    assert "Python stacks of every thread follow" in rank0, rank0[-3000:]
    assert "waiting for other ranks" in rank0, "rank 0 was blocked in a collective"
    assert job["attempt"] == 1
    steps = [p["step"] for p in dep.http.get(f"/jobs/{job_id}/metrics").json()["points"]]
    assert steps == [1, 2], f"the losses before the stall are kept: {steps}"
    dep.wait_for(lambda: dep.processes(job_id) == [], 30, "no rank process to be left")


# -- non-finite loss: the rank runtime as the local launcher starts it -------------------------


@pytest.fixture
def attempt_api(db: Database, settings: Settings) -> Iterator[str]:
    """The attempt API for the test's database, served on loopback: its URL."""
    with live_api(settings) as api:
        yield api.url


def _start(db: Database, spec: dict[str, Any]) -> int:
    with db.session() as s:
        register_worker(s, worker_id="e2e", host="h", pid=1, launcher="local", capacity={})
    with db.session() as s:
        job, _ = submit_job(s, JobSpec.model_validate(spec), owner="e2e")
        job_id = job.id
    with db.session() as s:
        claimed = claim_next_job(
            s, worker_id="e2e", launcher="local", max_gpus_per_node=0, lease_s=600
        )
        assert claimed is not None and claimed.id == job_id
    with db.session() as s:
        apply_transition(s, Transition(job_id, JobState.STARTING, JobState.RUNNING))
    return job_id


def _run_ranks(
    settings: Settings,
    api_url: str,
    job_id: int,
    timeout_s: float = 180,
    extra_env: dict[str, str] | None = None,
) -> int:
    """torchrun over ``worker.runtime`` for attempt 1, reporting to ``api_url``; its code."""
    token = prepare_attempt(settings, job_id, 1)
    # The ranks get no database URL: what they write goes through the attempt API.
    inherited = {k: v for k, v in os.environ.items() if k != contract.DATABASE_URL}
    env = dict(
        inherited,
        **(extra_env or {}),
        DDPQ_JOB_ID=str(job_id),
        DDPQ_ATTEMPT="1",
        DDPQ_API_URL=api_url,
        DDPQ_ATTEMPT_TOKEN=token,
        DDPQ_ARTIFACT_DIR=str(settings.resolved_artifact_dir),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    folder = artifacts.attempt_dir(settings.resolved_artifact_dir, job_id, 1)
    folder.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc_per_node", "2", "--max_restarts", "0", "-m", "worker.runtime"]  # fmt: skip
    with open(folder / "launcher.log", "ab") as out:
        proc = subprocess.Popen(
            argv, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        return proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _logs(settings: Settings, job_id: int) -> str:
    folder = artifacts.attempt_dir(settings.resolved_artifact_dir, job_id, 1)
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(folder.glob("*")))


def _points(db: Database, job_id: int, name: str) -> list[Any]:
    """Rows with ``step`` and ``value`` (NaN stored as null)."""
    with db.session(write=False) as s:
        return list(query_points(s, job_id, name, limit=100_000)[0])


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("nan_rank", [None, 1], ids=["nan-on-every-rank", "nan-on-rank-1"])
def test_nonfinite_fail_ends_every_rank_with_reason_and_step(
    db: Database, settings: Settings, attempt_api: str, nan_rank: int | None
) -> None:
    config = {"nan_at_step": 4, "nan_rank": nan_rank}
    job_id = _start(db, regression(config, nonfinite_loss="fail", checkpoint_every_steps=1))
    code = _run_ranks(settings, attempt_api, job_id)
    assert code != 0, _logs(settings, job_id)
    folder = artifacts.attempt_dir(settings.resolved_artifact_dir, job_id, 1)
    errors = {int(p.stem.rsplit("-", 1)[1]): json.loads(p.read_text())
              for p in folder.glob("error-rank-*.json")}  # fmt: skip
    assert set(errors) == {0, 1}, f"both ranks decide alike:\n{_logs(settings, job_id)}"
    for rank, error in errors.items():
        assert error["reason"] == "nonfinite_loss", error
        assert "at step 4 (training.nonfinite_loss=fail)" in error["message"], error
        poisoned = nan_rank is None or rank == nan_rank
        assert (f"rank {rank}'s loss was nan" in error["message"]) == poisoned, error
    assert not artifacts.result_path(settings.resolved_artifact_dir, job_id, 1).exists()
    with db.session(write=False) as s:
        newest = list_checkpoints(s, job_id)[0]
    assert newest.step == 3, "the failed step is never checkpointed"
    losses = [p.step for p in _points(db, job_id, "loss")]
    assert losses[:3] == [1, 2, 3], f"the losses before the failure are kept: {losses}"


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("nan_rank", [None, 1], ids=["nan-on-every-rank", "nan-on-rank-1"])
def test_nonfinite_skip_step_skips_on_every_rank_and_succeeds(
    db: Database, settings: Settings, attempt_api: str, nan_rank: int | None
) -> None:
    config = {"nan_at_step": 4, "nan_rank": nan_rank}
    job_id = _start(db, regression(config, nonfinite_loss="skip_step"))
    code = _run_ranks(settings, attempt_api, job_id)
    assert code == 0, _logs(settings, job_id)
    skipped = _points(db, job_id, "skipped_steps")
    assert [(p.step, p.value) for p in skipped] == [(4, 1.0)], skipped
    losses = _points(db, job_id, "loss")
    assert [p.step for p in losses] == list(range(1, STEPS + 1))
    # The reported loss is the mean over ranks: NaN (stored as null) at step 4 only.
    assert [p.step for p in losses if p.value is None] == [4], [p.value for p in losses]
    for rank in (0, 1):
        log = artifacts.rank_log_path(settings.resolved_artifact_dir, job_id, 1, rank)
        assert "at step 4: optimizer step skipped on every rank" in log.read_text(), rank
    with db.session(write=False) as s:
        newest = list_checkpoints(s, job_id)[0]
    # Shared (an absolute path), or uploaded by a rank whose first call to the API timed out
    # on a loaded box, so it could not tell that it shares the API's filesystem (a path
    # relative to the store's root, the artifact dir): either is the job's checkpoint.
    stored = Path(newest.path)
    stored = stored if stored.is_absolute() else settings.resolved_artifact_dir / stored
    state = torch.load(stored, map_location="cpu", weights_only=False)
    assert state["step"] == STEPS and state["skipped_steps"] == 1
    adam_steps = {float(v["step"]) for v in state["optimizer"]["state"].values()}
    assert adam_steps == {STEPS - 1.0}, "the optimizer stepped on every step but the NaN one"
    assert all(torch.isfinite(t).all() for t in state["model"].values()), "weights stay finite"


# A custom loop whose loss becomes NaN at step 4 on every rank (its gradients stay finite, so
# only the policy on what it reports can catch it); its own optimizer keeps stepping.
NAN_LOOP = """
import math
import torch
from torch import nn


def train(ctx):
    torch.manual_seed(0)
    model = ctx.wrap_model(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    for step in range(1, 11):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step == 4:
            loss = loss.detach() + math.nan
        ctx.report(step, 0, loss=loss.detach())
        if ctx.should_stop():
            return
"""


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_custom_entrypoint_nonfinite_loss_fails_the_job_like_a_builtin(
    db: Database, settings: Settings, attempt_api: str, tmp_path: Path
) -> None:
    package = tmp_path / "entrypoints"
    package.mkdir()
    (package / "nanloop_e2e.py").write_text(NAN_LOOP)
    spec = {
        "name": "custom-nan",
        "task": "nanloop_e2e:train",
        "resources": {"nproc_per_node": 2},
        "training": {"nonfinite_loss": "fail"},
    }
    job_id = _start(db, spec)
    extra = {
        "DDPQ_ALLOWED_ENTRYPOINTS": '["nanloop_*:*"]',
        "PYTHONPATH": os.pathsep.join([str(package), str(REPO)]),
    }
    code = _run_ranks(settings, attempt_api, job_id, extra_env=extra)
    assert code != 0, _logs(settings, job_id)
    folder = artifacts.attempt_dir(settings.resolved_artifact_dir, job_id, 1)
    errors = {int(p.stem.rsplit("-", 1)[1]): json.loads(p.read_text())
              for p in folder.glob("error-rank-*.json")}  # fmt: skip
    assert errors, _logs(settings, job_id)
    for rank, error in errors.items():
        assert error["reason"] == "nonfinite_loss", (rank, error)
        assert error["exc_type"] == "NonFiniteLossError", error
        assert "at step 4 (training.nonfinite_loss=fail)" in error["message"], error
    assert 0 in errors, "rank 0 (whose values are recorded) fails with the reason"
    assert not artifacts.result_path(settings.resolved_artifact_dir, job_id, 1).exists()
    losses = [p.step for p in _points(db, job_id, "loss")]
    assert losses[:4] == [1, 2, 3, 4], f"the losses up to the bad one are recorded: {losses}"
