"""``run_rank`` in this process (as the Slurm launcher calls it), strategy dp, reporting through
the real attempt API into SQLite and PostgreSQL: result.json, rank log, stop on SIGTERM with a
checkpoint, failures, fencing, the spec file, a start while the API is down."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.core import artifacts
from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.store.checkpoints.crud import list_checkpoints
from service.store.db import Database
from service.store.jobs.crud import Transition, apply_transition
from service.store.metrics.points import query_points
from tests.rank_api import LiveApi, live_api, mint_token, running_job
from worker import attempt as contract
from worker.runtime.main import run_rank
from worker.runtime.topology import RankEnv, RankEnvironmentError

TINY = {"num_samples": 64, "in_features": 4, "hidden": 8, "out_features": 2}


def start_job(db: Database, settings: Settings, spec: dict[str, Any]) -> tuple[int, int]:
    """A running job with its spec file written, as the worker leaves it for the ranks."""
    job_id, attempt = running_job(db, JobSpec.model_validate(spec))
    path = artifacts.spec_path(settings.resolved_artifact_dir, job_id, attempt)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(JobSpec.model_validate(spec).model_dump_json())
    return job_id, attempt


@pytest.fixture
def api(db: Database, settings: Settings) -> Iterator[LiveApi]:
    with live_api(settings) as served:
        yield served


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
    """A private os.environ (run_rank copies the given mapping into it) plus the rank's vars:
    no database URL (a rank has none)."""
    monkeypatch.setattr(os, "environ", dict(os.environ))
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    os.environ.pop(contract.DATABASE_URL, None)
    return {
        "DDPQ_ARTIFACT_DIR": str(settings.resolved_artifact_dir),
        "DDPQ_ALLOWED_ENTRYPOINTS": "[]",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }


def ids(db: Database, api_url: str, job_id: int, attempt: int) -> dict[str, str]:
    """The attempt's identity, API URL and a freshly minted token."""
    return {
        "DDPQ_JOB_ID": str(job_id),
        "DDPQ_ATTEMPT": str(attempt),
        contract.API_URL: api_url,
        contract.ATTEMPT_TOKEN: mint_token(db, job_id, attempt),
    }


API = {contract.API_URL: "http://127.0.0.1:8000", contract.ATTEMPT_TOKEN: "ddpqa_t"}


def test_rank_env_needs_the_job_identity_and_the_attempt_api() -> None:
    with pytest.raises(RankEnvironmentError, match="DDPQ_JOB_ID is not set"):
        RankEnv.from_environ({"DDPQ_ATTEMPT": "1", **API})
    with pytest.raises(RankEnvironmentError, match="outside WORLD_SIZE"):
        RankEnv.from_environ(
            {"DDPQ_JOB_ID": "1", "DDPQ_ATTEMPT": "1", "RANK": "2", "WORLD_SIZE": "2", **API}
        )
    for missing in API:
        partial = {k: v for k, v in API.items() if k != missing}
        with pytest.raises(RankEnvironmentError, match=f"{missing} is not set"):
            RankEnv.from_environ({"DDPQ_JOB_ID": "1", "DDPQ_ATTEMPT": "1", **partial})
    env = RankEnv.from_environ(
        {"DDPQ_JOB_ID": "3", "DDPQ_ATTEMPT": "2", "DDPQ_PG_TIMEOUT_S": "9", **API}
    )
    assert (env.job_id, env.attempt, env.rank, env.world_size, env.pg_timeout_s) == (
        3,
        2,
        0,
        1,
        9.0,
    )
    assert (env.api_url, env.attempt_token) == ("http://127.0.0.1:8000", "ddpqa_t")
    assert "ddpqa_t" not in repr(env), "the token must not end up in a log line"


def test_run_rank_in_process_succeeds(
    db: Database, settings: Settings, api: LiveApi, rank_environ: dict[str, str]
) -> None:
    job_id, attempt = start_job(db, settings, dp_spec())
    stdout_before = os.fstat(1)
    assert run_rank({**rank_environ, **ids(db, api.url, job_id, attempt)}) == 0
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
    db: Database, settings: Settings, api: LiveApi, rank_environ: dict[str, str]
) -> None:
    job_id, attempt = start_job(
        db, settings, dp_spec(epochs=1000, config={"sleep_per_step_ms": 20})
    )
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
        code = run_rank({**rank_environ, **ids(db, api.url, job_id, attempt)})
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
    db: Database, settings: Settings, api: LiveApi, rank_environ: dict[str, str]
) -> None:
    job_id, attempt = start_job(
        db, settings, {"name": "e", "task": "examples.custom_loop:train", "strategy": "dp"}
    )
    assert run_rank({**rank_environ, **ids(db, api.url, job_id, attempt)}) == 1
    path = artifacts.rank_error_path(settings.resolved_artifact_dir, job_id, attempt, 0)
    error = json.loads(path.read_text())
    assert error["rank"] == 0 and error["exc_type"] == "EntrypointError"
    assert "not allowed" in error["message"] and "Traceback" in error["traceback"]
    assert isinstance(error["time"], float)


def test_stale_attempt_exits_without_running(
    db: Database, settings: Settings, api: LiveApi, rank_environ: dict[str, str]
) -> None:
    job_id, attempt = start_job(db, settings, dp_spec())
    with db.session() as s:
        apply_transition(s, Transition(job_id, JobState.RUNNING, JobState.QUEUED))
    assert run_rank({**rank_environ, **ids(db, api.url, job_id, attempt)}) == 75
    attempt_dir = artifacts.attempt_dir(settings.resolved_artifact_dir, job_id, attempt)
    assert sorted(p.name for p in attempt_dir.iterdir()) == ["rank-0.log", "spec.json"]


def test_a_missing_or_invalid_spec_file_is_a_setup_error_naming_it(
    db: Database, settings: Settings, api: LiveApi, rank_environ: dict[str, str]
) -> None:
    root = settings.resolved_artifact_dir
    job_id, attempt = start_job(db, settings, dp_spec())
    spec_file = artifacts.spec_path(root, job_id, attempt)
    for content in (None, "{not json", json.dumps({"name": "x"})):
        if content is None:
            spec_file.unlink()
        else:
            spec_file.write_text(content)
        assert run_rank({**rank_environ, **ids(db, api.url, job_id, attempt)}) == 1
        error = json.loads(artifacts.rank_error_path(root, job_id, attempt, 0).read_text())
        assert error["exc_type"] == "SpecFileError" and str(spec_file) in error["message"]
        assert error["reason"] == "setup", "the same file would fail the same way: no retry"


def test_a_rank_starts_while_the_api_is_down_and_reports_once_it_is_back(
    db: Database, settings: Settings, rank_environ: dict[str, str]
) -> None:
    job_id, attempt = start_job(db, settings, dp_spec(config={"sleep_per_step_ms": 100}))
    api = LiveApi(settings)  # not serving yet: the start-up check and first writes fail
    starter = threading.Timer(2.0, api.start)
    starter.start()
    try:
        started = time.monotonic()
        code = run_rank({**rank_environ, **ids(db, api.url, job_id, attempt)})
    finally:
        starter.join()
        api.stop()
    assert code == 0, "an unreachable API at start is no reason not to train"
    assert time.monotonic() - started < 60
    with db.session(write=False) as s:
        points, _ = query_points(s, job_id, "loss")
        checkpoints = list_checkpoints(s, job_id)
    assert [p.step for p in points] == list(range(1, 9)), "every step once, after the outage"
    assert checkpoints and checkpoints[0].step == 8, "the final checkpoint, recorded"
    log_text = artifacts.rank_log_path(settings.resolved_artifact_dir, job_id, attempt, 0)
    assert "attempt API not reachable at start" in log_text.read_text()


def test_missing_identity_fails_fast(rank_environ: dict[str, str], tmp_path: Path) -> None:
    assert run_rank(dict(rank_environ)) == 1
