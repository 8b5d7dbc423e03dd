"""The rank runtime end to end: real jobs in a migrated database, the real attempt API on
loopback, real torchrun processes (gloo on CPU), as the local launcher starts them:
``torch.distributed.run … -m worker.runtime`` with the attempt's spec file, the API's URL and
a freshly minted attempt token, and no database URL."""

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
import yaml
from sqlalchemy import select, update

from service.core import artifacts
from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.core.spec.task_configs import DigitsConfig
from service.core.states import JobState
from service.store.checkpoints.crud import list_checkpoints
from service.store.db import Database
from service.store.jobs.claims import claim_next_job
from service.store.jobs.crud import Transition, apply_transition, get_job, submit_job
from service.store.models import Job, Metric
from service.store.workers.registry import register_worker
from tests.rank_api import live_api, prepare_attempt
from worker import attempt as contract
from worker.runtime.checkpoints.files import file_sha256
from worker.tasks.digits import build_model

REPO = Path(__file__).resolve().parents[2]
SQLITE_ONLY = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
POSTGRES_ONLY = pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
TORCHRUN = "torch.distributed.run"


@pytest.fixture(autouse=True)
def attempt_api(db: Database, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The attempt API for the test's database; ``launch`` hands its URL to the ranks."""
    with live_api(settings) as api:
        monkeypatch.setenv(contract.API_URL, api.url)
        yield api.url


def example(name: str, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load((REPO / "examples" / f"{name}.yaml").read_text())
    for key, value in overrides.items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) else value
    return spec


def regression(config: dict[str, Any] | None = None, **training: Any) -> dict[str, Any]:
    return {
        "name": "regression",
        "task": "regression",
        "resources": {"nproc_per_node": 2},
        "config": {"num_samples": 1024, **(config or {})},
        "training": {"epochs": 1, "batch_size": 32, "log_every_steps": 1, **training},
    }


def start_job(db: Database, spec: dict[str, Any]) -> int:
    """Submit, claim as worker "e2e" and mark running, as the worker loop does."""
    with db.session() as s:
        register_worker(s, worker_id="e2e", host="h", pid=1, launcher="local", capacity={})
    with db.session() as s:
        job, _ = submit_job(s, JobSpec.model_validate(spec), owner="e2e")
        job_id = job.id
    claim_and_run(db)
    return job_id


def claim_and_run(db: Database) -> tuple[int, int]:
    with db.session() as s:
        job = claim_next_job(s, worker_id="e2e", launcher="local", max_gpus_per_node=0, lease_s=600)
        assert job is not None
        job_id, attempt = job.id, job.attempt
    with db.session() as s:
        apply_transition(s, Transition(job_id, JobState.STARTING, JobState.RUNNING))
    return job_id, attempt


def rank_command(nproc: int, launcher: str = TORCHRUN) -> list[str]:
    """torchrun (or ``worker.runtime.agent``, the local launcher's warm-rank torchrun)."""
    return [
        sys.executable,
        "-m",
        launcher,
        "--standalone",
        "--nnodes",
        "1",
        "--nproc_per_node",
        str(nproc),
        "--max_restarts",
        "0",
        "-m",
        "worker.runtime",
    ]


def launch(
    settings: Settings,
    job_id: int,
    attempt: int,
    nproc: int,
    launcher: str = TORCHRUN,
) -> subprocess.Popen[bytes]:
    token = prepare_attempt(settings, job_id, attempt)
    inherited = {k: v for k, v in os.environ.items() if k != contract.DATABASE_URL}
    env = dict(
        inherited,
        DDPQ_JOB_ID=str(job_id),
        DDPQ_ATTEMPT=str(attempt),
        DDPQ_ATTEMPT_TOKEN=token,
        DDPQ_ARTIFACT_DIR=str(settings.resolved_artifact_dir),
        DDPQ_ALLOWED_ENTRYPOINTS='["examples.*:*", "tests.e2e.rank_probe:*"]',
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    assert env[contract.API_URL], "the attempt_api fixture sets the API's URL"
    log = artifacts.attempt_dir(settings.resolved_artifact_dir, job_id, attempt)
    log.mkdir(parents=True, exist_ok=True)
    with open(log / "launcher.log", "ab") as out:
        return subprocess.Popen(
            rank_command(nproc, launcher),
            env=env,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def run_attempt(
    settings: Settings, job_id: int, attempt: int, nproc: int = 2, timeout_s: float = 240,
    launcher: str = TORCHRUN,
) -> int:  # fmt: skip
    proc = launch(settings, job_id, attempt, nproc, launcher)
    try:
        return proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def diagnostics(settings: Settings, job_id: int, attempt: int) -> str:
    folder = artifacts.attempt_dir(settings.resolved_artifact_dir, job_id, attempt)
    parts = [f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(folder.glob("*"))]
    return "\n".join(parts)


def result_of(settings: Settings, job_id: int, attempt: int) -> dict[str, Any]:
    path = artifacts.result_path(settings.resolved_artifact_dir, job_id, attempt)
    assert path.exists(), f"no result.json:\n{diagnostics(settings, job_id, attempt)}"
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def points(db: Database, job_id: int, name: str) -> list[Metric]:
    """The stored rows (with the attempt that wrote each), ascending by step."""
    with db.session(write=False) as s:
        stmt = select(Metric).where(Metric.job_id == job_id, Metric.name == name)
        return list(s.scalars(stmt.order_by(Metric.step)))


def wait_for_steps(db: Database, job_id: int, n: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 180
    while len(points(db, job_id, "loss")) < n:
        assert proc.poll() is None, "the ranks ended before they were stopped"
        assert time.monotonic() < deadline, f"fewer than {n} loss points after 180 s"
        time.sleep(0.5)


@SQLITE_ONLY
def test_digits_two_ranks_learns_records_and_checkpoints(db: Database, settings: Settings) -> None:
    spec = example("digits")
    job_id = start_job(db, spec)
    code = run_attempt(settings, job_id, 1)
    result = result_of(settings, job_id, 1)
    assert code == 0, diagnostics(settings, job_id, 1)
    steps_per_epoch = 23  # ceil(ceil(1437 / 2) / 32)
    assert result["status"] == "succeeded" and result["step"] == 10 * steps_per_epoch

    accuracy = points(db, job_id, "eval_accuracy")
    assert len(accuracy) == 10, "one eval per epoch"
    assert accuracy[-1].value is not None and accuracy[-1].value >= 0.95, accuracy[-1].value
    assert result["final_metrics"]["eval_accuracy"] == accuracy[-1].value
    loss_steps = [p.step for p in points(db, job_id, "loss")]
    assert loss_steps == list(range(1, result["step"] + 1)), "exactly one loss row per step"

    with db.session(write=False) as s:
        job = get_job(s, job_id)
        assert job.progress is not None and job.progress["step"] == result["step"]
        assert job.progress["total_steps"] == result["step"]
        checkpoints = list_checkpoints(s, job_id)
    assert 1 <= len(checkpoints) <= spec["training"]["keep_checkpoints"]
    newest = checkpoints[0]
    assert newest.step == result["step"] and result["checkpoint"] == newest.path
    assert file_sha256(Path(newest.path)) == newest.sha256
    state = torch.load(newest.path, map_location="cpu", weights_only=False)
    bare = build_model(DigitsConfig.model_validate(spec["config"]))
    bare.load_state_dict(state["model"], strict=True)
    assert state["step"] == result["step"] and state["epoch"] == 9
    assert set(state) >= {
        "batch_idx",
        "epoch",
        "model",
        "optimizer",
        "rng",
        "step",
        "sampler_epoch",
    }


@POSTGRES_ONLY
def test_resume_continues_exactly_where_the_checkpoint_left_off(
    db: Database, settings: Settings
) -> None:
    # 1024 samples / 2 ranks / 32 per batch = 16 steps per epoch; step 10 is mid-epoch.
    job_id = start_job(db, regression(epochs=3, max_steps=10, checkpoint_every_steps=4))
    assert run_attempt(settings, job_id, 1) == 0, diagnostics(settings, job_id, 1)
    assert result_of(settings, job_id, 1)["step"] == 10

    with db.session() as s:  # the worker requeues it (attempt 2); it asks for more steps
        apply_transition(s, Transition(job_id, JobState.RUNNING, JobState.QUEUED, "test"))
        spec = s.scalar(select(Job.spec).where(Job.id == job_id))
        spec["training"] = {**spec["training"], "max_steps": 25}
        s.execute(update(Job).where(Job.id == job_id).values(spec=spec))
    assert claim_and_run(db) == (job_id, 2)
    assert run_attempt(settings, job_id, 2) == 0, diagnostics(settings, job_id, 2)
    assert result_of(settings, job_id, 2)["step"] == 25
    log = artifacts.rank_log_path(settings.resolved_artifact_dir, job_id, 2, 1).read_text()
    assert "step 10, epoch 0, batch_idx 10" in log, "every rank resumes from the same place"

    resumed = points(db, job_id, "loss")
    assert [p.step for p in resumed] == list(range(1, 26)), "steps continue, rows unique"
    assert {p.attempt for p in resumed if p.step <= 10} == {1}
    assert {p.attempt for p in resumed if p.step > 10} == {2}

    # The same job without interruption: identical losses after the resume point prove the
    # model, optimizer, RNG and position in the epoch were all restored.
    straight = start_job(db, regression(epochs=3, max_steps=25, checkpoint_every_steps=4))
    assert run_attempt(settings, straight, 1) == 0, diagnostics(settings, straight, 1)
    expected = [p.value for p in points(db, straight, "loss")]
    assert [p.value for p in resumed] == pytest.approx(expected, rel=1e-4)


@SQLITE_ONLY
def test_failing_rank_is_named_and_the_job_ends_quickly(db: Database, settings: Settings) -> None:
    job_id = start_job(db, regression({"fail_rank": 1, "fail_at_step": 5}, epochs=5))
    proc = launch(settings, job_id, 1, 2)
    try:
        code = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    ended_s = time.time()
    assert code != 0
    root = settings.resolved_artifact_dir
    assert not artifacts.result_path(root, job_id, 1).exists()
    errors = [
        json.loads(p.read_text())
        for p in artifacts.attempt_dir(root, job_id, 1).glob("error-rank-*.json")
    ]
    earliest = min(errors, key=lambda e: e["time"])
    assert earliest["rank"] == 1 and earliest["exc_type"] == "RuntimeError", errors
    assert "rank 1 at step 5" in earliest["message"]
    assert ended_s - earliest["time"] < 30, "the other rank must not hang after a failure"
    # Points buffered since the last collective flush die with the ranks; none is from step 5.
    written = [p.step for p in points(db, job_id, "loss")]
    assert written == list(range(1, len(written) + 1)) and len(written) <= 4, written


@SQLITE_ONLY
@pytest.mark.parametrize(
    "spec",
    [
        regression(epochs=2),
        example("digits", training={"epochs": 2, "batch_size": 64}),
    ],
    ids=["regression", "digits"],
)
def test_strategy_dp_runs_in_one_process(
    db: Database, settings: Settings, spec: dict[str, Any]
) -> None:
    spec = {**spec, "strategy": "dp", "resources": {"nproc_per_node": 1}}
    job_id = start_job(db, spec)
    code = run_attempt(settings, job_id, 1, nproc=1)
    result = result_of(settings, job_id, 1)
    assert code == 0
    assert [p.step for p in points(db, job_id, "loss")] == list(range(1, result["step"] + 1))
    if spec["task"] == "digits":
        assert len(points(db, job_id, "eval_accuracy")) == 2
    log = artifacts.rank_log_path(settings.resolved_artifact_dir, job_id, 1, 0).read_text()
    assert "process group up" not in log, "dp runs without a process group"


@SQLITE_ONLY
def test_sigterm_stops_every_rank_at_the_same_step(db: Database, settings: Settings) -> None:
    job_id = start_job(db, regression({"sleep_per_step_ms": 50}, epochs=100))
    proc = launch(settings, job_id, 1, 2)
    try:
        wait_for_steps(db, job_id, 5, proc)
        os.killpg(proc.pid, signal.SIGTERM)  # the launcher signals the whole process group
        sent_s = time.monotonic()
        code = proc.wait(timeout=60)
        assert time.monotonic() - sent_s < 30
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code != 0
    root = settings.resolved_artifact_dir
    assert not artifacts.result_path(root, job_id, 1).exists()
    assert not list(artifacts.attempt_dir(root, job_id, 1).glob("error-rank-*.json"))
    stops = [
        line.split("stopped at step ")[1].split()[0]
        for rank in (0, 1)
        for line in artifacts.rank_log_path(root, job_id, 1, rank).read_text().splitlines()
        if "stopped at step" in line
    ]
    assert len(stops) == 2 and stops[0] == stops[1], stops
    with db.session(write=False) as s:
        assert list_checkpoints(s, job_id)[0].step == int(stops[0])


@SQLITE_ONLY
def test_sigterm_ends_a_hung_job(db: Database, settings: Settings) -> None:
    job_id = start_job(db, regression({"hang_rank": 1, "hang_at_step": 3}, epochs=5))
    proc = launch(settings, job_id, 1, 2)
    log = artifacts.rank_log_path(settings.resolved_artifact_dir, job_id, 1, 1)
    try:
        deadline = time.monotonic() + 180
        while not (log.exists() and "injected hang" in log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "rank 1 never hung"
            time.sleep(0.5)
        time.sleep(1.0)  # rank 0 is now blocked in the step's all_reduce
        os.killpg(proc.pid, signal.SIGTERM)
        sent_s = time.monotonic()
        code = proc.wait(timeout=60)
        assert time.monotonic() - sent_s < 30, "a rank blocked in a collective must not linger"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code != 0
    folder = artifacts.attempt_dir(settings.resolved_artifact_dir, job_id, 1)
    assert not list(folder.glob("error-rank-*.json")), "a stop on a signal is not a failure"
    assert not artifacts.result_path(settings.resolved_artifact_dir, job_id, 1).exists()


@SQLITE_ONLY
def test_fenced_off_attempt_stops(db: Database, settings: Settings) -> None:
    job_id = start_job(db, regression({"sleep_per_step_ms": 50}, epochs=100))
    proc = launch(settings, job_id, 1, 2)
    try:
        wait_for_steps(db, job_id, 3, proc)
        with db.session() as s:  # the job is cancelled (or requeued) behind the ranks' back
            apply_transition(s, Transition(job_id, JobState.RUNNING, JobState.CANCELLED))
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code != 0
    assert not artifacts.result_path(settings.resolved_artifact_dir, job_id, 1).exists()


@SQLITE_ONLY
def test_user_entrypoint_two_ranks(db: Database, settings: Settings) -> None:
    job_id = start_job(db, example("custom_loop", training={"epochs": 4}))
    assert run_attempt(settings, job_id, 1) == 0, diagnostics(settings, job_id, 1)
    result = result_of(settings, job_id, 1)
    assert result["final_metrics"]["eval_accuracy"] >= 0.9
    assert len(points(db, job_id, "eval_accuracy")) == 4, "one eval per epoch"
    assert [p.step for p in points(db, job_id, "loss")] == list(range(1, result["step"] + 1))
    with db.session(write=False) as s:
        assert list_checkpoints(s, job_id)[0].step == result["step"]


@pytest.mark.slow
@SQLITE_ONLY
def test_charlm_loss_falls_over_200_steps(db: Database, settings: Settings) -> None:
    spec = example(
        "charlm",
        config={"context": 32, "corpus_bytes": 300_000},
        training={"max_steps": 200, "checkpoint_every_steps": 100},
    )
    job_id = start_job(db, spec)
    assert run_attempt(settings, job_id, 1, timeout_s=540) == 0, diagnostics(settings, job_id, 1)
    losses = [p.value for p in points(db, job_id, "loss")]
    assert len(losses) == 200 and all(v is not None for v in losses)
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20  # type: ignore[arg-type]
    assert last < first - 1.0, f"loss did not fall: first 20 avg {first:.3f}, last 20 {last:.3f}"
    assert points(db, job_id, "tokens_per_s"), "charlm reports throughput"


@SQLITE_ONLY
@pytest.mark.parametrize("launcher", [TORCHRUN, "worker.runtime.agent"])
def test_ranks_load_no_database_driver(db: Database, settings: Settings, launcher: str) -> None:
    """Every rank of a real 2-rank job (under plain torchrun, and forked warm by the local
    launcher's agent) reports, after training and a flush, what it has loaded: no
    SQLAlchemy, no psycopg, no database URL in its environment."""
    spec = {
        "name": "probe",
        "task": "tests.e2e.rank_probe:train",
        "resources": {"nproc_per_node": 2},
        "training": {"epochs": 1},
    }
    job_id = start_job(db, spec)
    code = run_attempt(settings, job_id, 1, launcher=launcher)
    assert code == 0, diagnostics(settings, job_id, 1)
    folder = artifacts.attempt_dir(settings.resolved_artifact_dir, job_id, 1)
    probes = {rank: json.loads((folder / f"probe-rank-{rank}.json").read_text()) for rank in (0, 1)}
    for rank, probe in probes.items():
        assert probe == {"sqlalchemy": False, "psycopg": False, "database_url": False}, (
            f"rank {rank} holds database machinery: {probe}"
        )
    stored = points(db, job_id, "sqlalchemy_loaded")
    assert [(p.step, p.value) for p in stored] == [(3, 0.0)], "rank 0 reported it, as 0"
    assert [p.step for p in points(db, job_id, "loss")] == [1, 2, 3]
