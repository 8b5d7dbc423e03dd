"""Failures told fast and right, with real torchrun ranks driven through the local launcher
(no worker process: the launcher is what decides, and each run stays short). The ranks report
to the real attempt API on loopback with a token minted per attempt, as a worker's would.

- A rank SIGKILLed mid-training is blamed, with its signal, over the peer whose collective saw
  it go, run after run (torchrun's agent may name either rank, reports arrive in any order).
- A known failure ends the attempt within seconds while a peer sits in user code far from a
  step boundary; a rank that gets no step boundary within its stop grace leaves on its own.
- An entrypoint that does not resolve fails in under 2 s with the ranks' ``setup`` error.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.store import migrate
from service.store.db import Database
from service.store.jobs.claims import claim_next_job
from service.store.jobs.crud import submit_job
from service.store.models import Metric
from service.store.workers.registry import register_worker
from tests.rank_api import LiveApi, mint_token
from tests.waiting import wait_until
from worker.attempt import FailureReason
from worker.launchers.base import LaunchPlan, RunPhase, RunStatus, with_attempt_token
from worker.launchers.local.launcher import LocalLauncher
from worker.processes import find_tagged_processes

REPO = Path(__file__).resolve().parents[2]
SLOW_BOX_S = 180.0  # any wait on a loaded 2-core box; only reached when something is wrong
# "Fast" is well under torchrun's 30 s SIGTERM→SIGKILL wait, with room for a loaded box (the
# launcher's own grace is 2 s, the ranks' stop grace 1 s here).
FAST_S = 15.0
ALLOWED = ["examples.*:*", "ddpq_e2e_entry:*"]
# Rank 1 sleeps in user code before its first collective; rank 0's first collective then times
# out (DDPQ_PG_TIMEOUT_S) and rank 0 writes the attempt's error file.
SLEEPY_ENTRY = textwrap.dedent(
    """
    import time
    import torch
    import torch.distributed as dist

    def train(ctx):
        if ctx.rank == 1:
            time.sleep(120)
        dist.all_reduce(torch.ones(1))
    """
)


def regression_spec(**config: Any) -> dict[str, Any]:
    return {
        "name": "blame",
        "task": "regression",
        "config": {"num_samples": 64, "sleep_per_step_ms": 300, **config},
        "resources": {"nproc_per_node": 2, "cpus_per_task": 1},
        "training": {"epochs": 50, "batch_size": 8},
    }


@dataclass
class Harness:
    """A database, an artifact dir and a local launcher: what a worker would hold."""

    settings: Settings
    db: Database
    tmp_path: Path

    def launcher(self, **kwargs: Any) -> LocalLauncher:
        return LocalLauncher(self.settings, cwd=REPO, **kwargs)

    def claimed(self, spec: dict[str, Any]) -> tuple[JobSpec, int, int]:
        """Submit ``spec`` and claim it as a worker would: (spec, job_id, attempt)."""
        job_spec = JobSpec.model_validate(spec)
        with self.db.session() as session:
            submit_job(session, job_spec, owner="test")
        with self.db.session() as session:
            job = claim_next_job(session, worker_id="w", launcher="local",
                                 max_gpus_per_node=0, lease_s=3600)  # fmt: skip
            assert job is not None
            return job_spec, job.id, job.attempt

    def plan(self, launcher: LocalLauncher, spec: dict[str, Any], **env: str) -> LaunchPlan[Any]:
        """A claimed job's plan with its attempt token, as the worker loop launches it."""
        job_spec, job_id, attempt = self.claimed(spec)
        plan = launcher.plan(job_spec, job_id, attempt)
        plan = with_attempt_token(plan, mint_token(self.db, job_id, attempt))
        extra = {"DDPQ_ALLOWED_ENTRYPOINTS": json.dumps(ALLOWED), "OMP_NUM_THREADS": "1"}
        return replace(plan, env={**plan.env, **extra, **env})

    def loss_rows(self, job_id: int) -> int:
        with self.db.session(write=False) as session:
            stmt = select(func.count()).where(Metric.job_id == job_id, Metric.name == "loss")
            return int(session.execute(stmt).scalar_one())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    """The database, the attempt API on the settings' port (the launcher's ranks report
    there: ``resolved_api_url``) and the artifact dir; no process of it may be left."""
    settings = Settings(
        home=tmp_path / ".ddpq",
        database_url=f"sqlite:///{tmp_path / 'ddpq.db'}",
        artifact_dir=tmp_path / "artifacts",
        allowed_entrypoints=ALLOWED,
        port=_free_port(),
    )
    db = Database.from_url(settings.resolved_database_url)
    migrate.upgrade(db.engine)
    with db.session() as session:
        register_worker(session, worker_id="w", host="test", pid=os.getpid(), launcher="local",
                        capacity={"slots": 100, "gpus": []})  # fmt: skip
    api = LiveApi(settings, port=settings.port)
    api.start()
    try:
        yield Harness(settings, db, tmp_path)
    finally:
        api.stop()
        db.dispose()
    left = rank_pids(settings.resolved_artifact_dir)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {left}"


def rank_pids(artifact_dir: Path, job_id: int | None = None) -> list[int]:
    """Pids whose environment carries this test's artifact dir (and ``job_id``, attempt 1):
    torchrun, the fork server and the ranks (forked ranks show the fork server's initial
    environment in /proc, without RANK: which rank a pid is comes from its log)."""
    needles = {f"DDPQ_ARTIFACT_DIR={artifact_dir}".encode()}
    if job_id is not None:
        needles |= {f"DDPQ_JOB_ID={job_id}".encode(), b"DDPQ_ATTEMPT=1"}
    return find_tagged_processes(frozenset(needles))


def rank_pid(attempt_dir: Path, rank: int) -> int:
    """The pid rank ``rank`` logged at its start ("rank 1/2 starting (local_rank 1, pid N)")."""
    log = attempt_dir / f"rank-{rank}.log"
    pattern = re.compile(rf"rank {rank}/\d+ starting \(local_rank \d+, pid (\d+)\)")

    def logged() -> int | None:
        m = pattern.search(log.read_text(errors="replace")) if log.exists() else None
        return int(m[1]) if m else None

    pid: int = wait_for(logged, f"rank {rank}'s pid in {log}")
    return pid


def wait_for(cond: Callable[[], Any], what: str, timeout_s: float = SLOW_BOX_S) -> Any:
    return wait_until(cond, timeout_s, what, every_s=0.05)


def wait_end(launcher: LocalLauncher, handle: str, every_s: float = 0.1) -> RunStatus:
    """Poll as a worker with a fast tick would, until the attempt ended."""

    def ended() -> RunStatus | None:
        status = launcher.poll(handle)
        return None if status.phase == RunPhase.RUNNING else status

    status: RunStatus = wait_for(ended, f"attempt {handle} to end")
    return status


# -- the right rank, run after run ---------------------------------------------------------
# Each run kills rank 1 at a random point of a step; DDPQ_BLAME_RUNS=50 for a longer hunt.
RUNS = int(os.environ.get("DDPQ_BLAME_RUNS", "5"))


@pytest.mark.slow
@pytest.mark.timeout(600)  # 5 launches: a loaded CI box needs more than the default 300 s
def test_a_sigkilled_rank_is_blamed_in_every_run(harness: Harness) -> None:
    """Rank 1 is SIGKILLed as soon as the first loss row is in, at a random point of a step
    (so rank 0 is sometimes in its collective, sometimes not: either its error file or
    torchrun's poll comes first); every run's error names rank 1 and SIGKILL, never rank 0's
    "Connection closed by peer"."""
    rng = random.Random(0)
    launcher = harness.launcher()
    artifact_dir = harness.settings.resolved_artifact_dir
    wrong: list[str] = []
    t0 = time.monotonic()
    for _ in range(RUNS):
        plan = harness.plan(launcher, regression_spec())
        handle = launcher.start(plan)
        wait_for(lambda p=plan: harness.loss_rows(p.job_id) > 0, "the first loss row")
        pid = rank_pid(Path(plan.log_dir), 1)
        assert pid in rank_pids(artifact_dir, plan.job_id), "rank 1 should carry the job's tags"
        time.sleep(rng.uniform(0.0, 0.3))  # one step is 0.3 s
        os.kill(pid, signal.SIGKILL)
        status = wait_end(launcher, handle)
        text = status.reason or ""
        if not (
            status.phase == RunPhase.FAILED and text.startswith("rank 1 exit code -9 (SIGKILL)")
        ):
            wrong.append(f"job {plan.job_id}: {status.phase}: {text[:300]}")
    elapsed = time.monotonic() - t0
    assert not wrong, f"{len(wrong)} of {RUNS} runs blamed the wrong rank:\n" + "\n".join(wrong)
    print(f"{RUNS} runs in {elapsed:.1f} s")


# -- a known failure ends the attempt fast -------------------------------------------------
def _sleepy_plan(harness: Harness, launcher: LocalLauncher, **env: str) -> LaunchPlan[Any]:
    (harness.tmp_path / "ddpq_e2e_entry.py").write_text(SLEEPY_ENTRY)
    spec = {**regression_spec(), "task": "ddpq_e2e_entry:train", "config": {}}
    pythonpath = os.pathsep.join([str(harness.tmp_path), str(REPO)])
    return harness.plan(launcher, spec, DDPQ_PG_TIMEOUT_S="5", PYTHONPATH=pythonpath, **env)


def _seconds_after_first_error(plan: LaunchPlan[Any], status: RunStatus, ended: float) -> float:
    errors = list(Path(plan.log_dir).glob("error-rank-*.json"))
    assert errors, f"no rank wrote an error file: {status}"
    return ended - min(p.stat().st_mtime for p in errors)


def test_a_known_failure_ends_the_attempt_while_a_peer_sleeps_in_user_code(
    harness: Harness,
) -> None:
    """Rank 0 times out waiting for rank 1 (asleep in user code, deaf to SIGTERM until a step
    boundary it never reaches): the attempt fails within seconds of rank 0's error file, not
    after torchrun's 30 s SIGTERM→SIGKILL wait."""
    launcher = harness.launcher()
    plan = _sleepy_plan(harness, launcher, DDPQ_STOP_GRACE_S="60")  # the launcher alone
    status = wait_end(launcher, launcher.start(plan))
    late_s = _seconds_after_first_error(plan, status, time.time())
    assert status.phase == RunPhase.FAILED, status
    assert (status.reason or "").startswith("setup: rank 0 failed"), status.reason
    assert late_s < FAST_S, f"failed {late_s:.1f} s after the first error file (torchrun: 30 s)"
    print(f"failed {late_s:.2f} s after rank 0's error file")


def test_a_rank_that_reaches_no_step_boundary_leaves_after_its_stop_grace(
    harness: Harness,
) -> None:
    """The same failure with the launcher's kill out of the way: torchrun SIGTERMs rank 1,
    which reaches no step boundary and exits on its own after DDPQ_STOP_GRACE_S."""
    launcher = harness.launcher(failure_grace_s=SLOW_BOX_S)
    plan = _sleepy_plan(harness, launcher, DDPQ_STOP_GRACE_S="1")
    status = wait_end(launcher, launcher.start(plan))
    late_s = _seconds_after_first_error(plan, status, time.time())
    assert status.phase == RunPhase.FAILED, status
    assert late_s < FAST_S, f"failed {late_s:.1f} s after the first error file (torchrun: 30 s)"
    log = (Path(plan.log_dir) / "rank-1.log").read_text(errors="replace")
    assert "no step boundary within 1.0 s" in log, log[-2000:]


# -- a bad entrypoint fails before any rank starts -----------------------------------------
@pytest.mark.parametrize(
    ("task", "message"),
    [
        ("examples.no_such_module:train",
         "setup: rank 0 failed before its first step: EntrypointError: cannot import "
         "'examples.no_such_module' for entrypoint 'examples.no_such_module:train': No module "
         "named 'examples.no_such_module'"),
        ("examples.custom_loop:no_such_function",
         "setup: rank 0 failed before its first step: EntrypointError: 'examples.custom_loop' "
         "has no function 'no_such_function'"),
    ],
)  # fmt: skip
def test_an_entrypoint_that_does_not_resolve_fails_in_under_2_s(
    harness: Harness, task: str, message: str
) -> None:
    launcher = harness.launcher()
    job_spec = JobSpec.model_validate({**regression_spec(), "task": task, "config": {}})
    plan = launcher.plan(job_spec, 1, 1)
    t0 = time.monotonic()
    handle = launcher.start(plan)
    status = wait_end(launcher, handle, every_s=0.01)
    elapsed = time.monotonic() - t0
    assert status.phase == RunPhase.FAILED and status.failure == FailureReason.SETUP, status
    assert (status.reason or "").startswith(message), status.reason
    assert elapsed < 2.0, f"took {elapsed:.2f} s (expected < 2 s: no rank should start)"
    assert rank_pids(harness.settings.resolved_artifact_dir) == []


def test_an_entrypoint_that_resolves_is_not_refused(harness: Harness) -> None:
    """The check must not refuse what the ranks can load (``examples.custom_loop:train``)."""
    from worker.entrypoints import check_in_subprocess

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    assert check_in_subprocess("examples.custom_loop:train", python=sys.executable,
                               cwd=str(REPO), env=env) is None  # fmt: skip
