"""Rank processes die with torchrun: a SIGKILLed torchrun (it cannot stop its ranks) must not
leave real ``worker.runtime`` ranks training on (PR_SET_PDEATHSIG set by each rank)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from service.app import create_app
from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.store.attempts.tokens import mint_attempt_token
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs import crud as jobs
from service.store.metrics.points import query_points
from service.store.workers.registry import register_worker
from tests.live import serve_app
from worker.attempt import attempt_tags
from worker.launchers.base import with_attempt_token
from worker.launchers.local.launcher import LocalLauncher
from worker.processes import find_tagged_processes
from worker.runtime.main import die_with_parent

SLOW_BOX_S = 180.0  # start-up on a loaded 2-core machine; only reached when something is wrong
RANKS_GONE_S = 20.0  # SIGTERM → stop at a step boundary (checkpoint) → exit


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    """SQLite only: the database is not what is under test here."""
    return f"sqlite:///{tmp_path / 'ddpq.db'}"


@pytest.fixture
def api_settings(settings: Settings, db: Database) -> Iterator[Settings]:
    """``settings`` with ``api_url`` pointing at a live API on the same database: the ranks
    report there (they hold no database URL)."""
    with serve_app(create_app(settings)) as url:
        yield settings.model_copy(update={"api_url": url})


def _wait_for(cond: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)


def _running_job(db: Database, spec: JobSpec) -> tuple[int, int]:
    with db.session() as s:
        register_worker(s, worker_id="w", host="h", pid=1, launcher="local", capacity={})
        jobs.submit_job(s, spec, owner="o")
    with db.session() as s:
        job = claims.claim_next_job(
            s, worker_id="w", launcher="local", max_gpus_per_node=0, lease_s=3600
        )
        assert job is not None
        jobs.apply_transition(s, jobs.Transition(job.id, JobState.STARTING, JobState.RUNNING))
        return job.id, job.attempt


@pytest.mark.slow
def test_ranks_die_when_torchrun_is_killed(api_settings: Settings, db: Database) -> None:
    spec = JobSpec.model_validate(
        {
            "name": "orphans",
            "task": "regression",
            "resources": {"nproc_per_node": 2},
            "config": {"num_samples": 64, "in_features": 4, "hidden": 8, "out_features": 2,
                       "sleep_per_step_ms": 50},
            "training": {"epochs": 10_000, "batch_size": 8},
        }
    )  # fmt: skip
    job_id, attempt = _running_job(db, spec)
    launcher = LocalLauncher(api_settings)
    with db.session() as s:
        token = mint_attempt_token(s, job_id, attempt)
    plan = with_attempt_token(launcher.plan(spec, job_id, attempt), token)
    tags = attempt_tags(job_id, attempt, plan.env["DDPQ_ARTIFACT_DIR"])
    handle = launcher.start(plan)
    torchrun = int(handle)
    try:

        def training() -> bool:
            with db.session(write=False) as s:
                return len(query_points(s, job_id, "loss")[0]) >= 3

        _wait_for(training, SLOW_BOX_S, "the ranks to report losses")
        ranks = [pid for pid in find_tagged_processes(tags) if pid != torchrun]
        assert len(ranks) >= 2, f"expected 2 rank processes, found {ranks}"
        os.kill(torchrun, signal.SIGKILL)  # the agent only, not its process group
        try:
            _wait_for(
                lambda: not [p for p in find_tagged_processes(tags) if p != torchrun],
                RANKS_GONE_S,
                "the ranks to exit after torchrun was SIGKILLed",
            )
        except AssertionError as exc:
            left = [p for p in find_tagged_processes(tags) if p != torchrun]
            raise AssertionError(
                f"{exc}: ranks {left} outlived torchrun (each rank must set "
                "PR_SET_PDEATHSIG, see worker.runtime.main.die_with_parent)"
            ) from None
    finally:
        for pid in find_tagged_processes(tags):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.cancel(handle)  # reaps torchrun


def test_die_with_parent_is_a_no_op_outside_torchrun() -> None:
    assert die_with_parent({"DDPQ_JOB_ID": "1", "DDPQ_ATTEMPT": "1"}) is False


ARM = (
    "import sys; from worker.runtime.main import die_with_parent; "
    "armed = die_with_parent({'TORCHELASTIC_RUN_ID': 'r', 'DDPQ_JOB_ID': '77', "
    "'DDPQ_ATTEMPT': '3'}); print('alive', armed, flush=True)"
)


def test_rank_whose_launcher_is_already_gone_stops_at_once() -> None:
    """The race: torchrun died before the rank armed PR_SET_PDEATHSIG (the rank was adopted
    by another process, which does not run this job's attempt): the rank stops itself."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPQ_")}
    orphan = subprocess.run(
        [sys.executable, "-c", ARM], env=env, capture_output=True, timeout=SLOW_BOX_S
    )
    assert orphan.returncode == -signal.SIGTERM, (orphan.returncode, orphan.stdout, orphan.stderr)
    assert b"alive" not in orphan.stdout
    # Under a parent of its own attempt (as torchrun is) the rank keeps going. The trailing
    # "; true" keeps sh alive as the parent instead of exec'ing python.
    script = f"{sys.executable} -c {ARM!r}; true"
    env = {**env, "DDPQ_JOB_ID": "77", "DDPQ_ATTEMPT": "3"}
    child = subprocess.run(["sh", "-c", script], env=env, capture_output=True, timeout=SLOW_BOX_S)
    assert child.returncode == 0 and child.stdout.strip() == b"alive True", child
