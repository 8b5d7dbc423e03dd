"""``run_rank`` in this process (as the Slurm launcher calls it), strategy dp, on SQLite and
PostgreSQL: result.json, rank log, stop on SIGTERM with a checkpoint, failures, fencing."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from service.core import artifacts
from service.core.config import Settings
from service.core.spec import JobSpec
from service.core.states import JobState
from service.store.checkpoints import list_checkpoints
from service.store.claims import claim_next_job
from service.store.db import Database
from service.store.jobs import Transition, apply_transition, submit_job
from service.store.metrics import query_points
from service.store.workers import register_worker
from worker.runtime.main import run_rank
from worker.runtime.topology import RankEnv, RankEnvironmentError

TINY = {"num_samples": 64, "in_features": 4, "hidden": 8, "out_features": 2}


def start_job(db: Database, spec: dict[str, Any]) -> tuple[int, int]:
    with db.session() as s:
        register_worker(s, worker_id="w", host="h", pid=1, launcher="local", capacity={})
        submit_job(s, JobSpec.model_validate(spec), owner="o")
    with db.session() as s:
        job = claim_next_job(s, worker_id="w", launcher="local", max_gpus_per_node=0, lease_s=600)
        assert job is not None
        job_id, attempt = job.id, job.attempt
    with db.session() as s:
        apply_transition(s, Transition(job_id, JobState.STARTING, JobState.RUNNING))
    return job_id, attempt


def dp_spec(**training: Any) -> dict[str, Any]:
    config = dict(TINY, **training.pop("config", {}))
    return {
        "name": "dp",
        "task": "regression",
        "strategy": "dp",
        "config": config,
        "training": {"epochs": 2, "batch_size": 16, **training},
    }


@pytest.fixture
def rank_environ(monkeypatch: pytest.MonkeyPatch, settings: Settings) -> dict[str, str]:
    """A private os.environ (run_rank copies the given mapping into it) plus the rank's vars."""
    monkeypatch.setattr(os, "environ", dict(os.environ))
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    return {
        "DDPQ_DATABASE_URL": settings.resolved_database_url,
        "DDPQ_ARTIFACT_DIR": str(settings.resolved_artifact_dir),
        "DDPQ_ALLOWED_ENTRYPOINTS": "[]",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }


def ids(job_id: int, attempt: int) -> dict[str, str]:
    return {"DDPQ_JOB_ID": str(job_id), "DDPQ_ATTEMPT": str(attempt)}


def test_rank_env_needs_the_job_identity() -> None:
    with pytest.raises(RankEnvironmentError, match="DDPQ_JOB_ID is not set"):
        RankEnv.from_environ({"DDPQ_ATTEMPT": "1"})
    with pytest.raises(RankEnvironmentError, match="outside WORLD_SIZE"):
        RankEnv.from_environ(
            {"DDPQ_JOB_ID": "1", "DDPQ_ATTEMPT": "1", "RANK": "2", "WORLD_SIZE": "2"}
        )
    env = RankEnv.from_environ({"DDPQ_JOB_ID": "3", "DDPQ_ATTEMPT": "2", "DDPQ_PG_TIMEOUT_S": "9"})
    assert (env.job_id, env.attempt, env.rank, env.world_size, env.pg_timeout_s) == (
        3,
        2,
        0,
        1,
        9.0,
    )


def test_run_rank_in_process_succeeds(
    db: Database, settings: Settings, rank_environ: dict[str, str]
) -> None:
    job_id, attempt = start_job(db, dp_spec())
    stdout_before = os.fstat(1)
    assert run_rank({**rank_environ, **ids(job_id, attempt)}) == 0
    after = os.fstat(1)
    assert (after.st_dev, after.st_ino) == (stdout_before.st_dev, stdout_before.st_ino), (
        "run_rank must give fd 1 back after redirecting it"
    )
    root = settings.resolved_artifact_dir
    result = json.loads(artifacts.result_path(root, job_id, attempt).read_text())
    assert result["status"] == "succeeded" and result["step"] == 8  # 2 epochs × 64/16
    assert result["checkpoint"] == str(artifacts.checkpoint_path(root, job_id, 8))
    assert "loss" in result["final_metrics"]
    log_text = artifacts.rank_log_path(root, job_id, attempt, 0).read_text()
    assert "finished at step 8" in log_text and "rank=0" in log_text
    with db.session(write=False) as s:
        points, _ = query_points(s, job_id, "loss")
    assert [p.step for p in points] == list(range(1, 9))


def test_sigterm_stops_at_a_step_with_a_checkpoint_and_no_result(
    db: Database, settings: Settings, rank_environ: dict[str, str]
) -> None:
    job_id, attempt = start_job(db, dp_spec(epochs=1000, config={"sleep_per_step_ms": 20}))
    done = threading.Event()

    def terminate_once_training() -> None:  # the launcher's cancel, once steps are recorded
        while not done.wait(0.2):
            with db.session(write=False) as s:
                if len(query_points(s, job_id, "loss")[0]) >= 3:
                    os.kill(os.getpid(), signal.SIGTERM)
                    return

    killer = threading.Thread(target=terminate_once_training)
    killer.start()
    try:
        code = run_rank({**rank_environ, **ids(job_id, attempt)})
    finally:
        done.set()
        killer.join()
    assert code == 128 + signal.SIGTERM
    root = settings.resolved_artifact_dir
    assert not artifacts.result_path(root, job_id, attempt).exists()
    with db.session(write=False) as s:
        checkpoints = list_checkpoints(s, job_id)
        points, _ = query_points(s, job_id, "loss", limit=100_000)
    assert checkpoints, "a stop on a signal must leave a checkpoint to resume from"
    assert checkpoints[0].step == points[-1].step, "checkpoint at the step where it stopped"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "handlers must be restored"


def test_disallowed_entrypoint_fails_with_an_error_file(
    db: Database, settings: Settings, rank_environ: dict[str, str]
) -> None:
    job_id, attempt = start_job(
        db, {"name": "e", "task": "examples.custom_loop:train", "strategy": "dp"}
    )
    assert run_rank({**rank_environ, **ids(job_id, attempt)}) == 1
    path = artifacts.rank_error_path(settings.resolved_artifact_dir, job_id, attempt, 0)
    error = json.loads(path.read_text())
    assert error["rank"] == 0 and error["exc_type"] == "EntrypointError"
    assert "not allowed" in error["message"] and "Traceback" in error["traceback"]
    assert isinstance(error["time"], float)


def test_stale_attempt_exits_without_running(
    db: Database, settings: Settings, rank_environ: dict[str, str]
) -> None:
    job_id, attempt = start_job(db, dp_spec())
    with db.session() as s:
        apply_transition(s, Transition(job_id, JobState.RUNNING, JobState.QUEUED))
    assert run_rank({**rank_environ, **ids(job_id, attempt)}) == 75
    attempt_dir = artifacts.attempt_dir(settings.resolved_artifact_dir, job_id, attempt)
    assert sorted(p.name for p in attempt_dir.iterdir()) == ["rank-0.log"]


def test_missing_identity_fails_fast(rank_environ: dict[str, str], tmp_path: Path) -> None:
    assert run_rank(dict(rank_environ)) == 1
