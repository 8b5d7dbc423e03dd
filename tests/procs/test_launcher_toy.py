"""Adding a launcher is one class plus one row in the traits table: a toy launcher (a
``python -c`` subprocess per attempt), registered only by its row in ``LAUNCHER_TRAITS``, is a
valid ``launcher`` in a job spec and runs a job to success in a real WorkerLoop on real SQLite
and PostgreSQL, reached only through ``registry.make_launcher`` and its traits.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Self

import pytest

from service.core import launchers
from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.store.db import Database
from service.store.jobs import crud as jobs
from tests.db_records import DatabaseRecords
from worker.launchers import registry
from worker.launchers.base import LaunchPlan, RunPhase, RunStatus
from worker.loop import WorkerLoop

TOY = "toy"


@dataclass
class ToyLauncher:
    """Each attempt is one ``python -c`` process; its exit code decides the phase."""

    name: str = TOY
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    bound: list[tuple[int, ...]] = field(default_factory=list)

    @classmethod
    def from_settings(cls, settings: Settings) -> Self:
        return cls()

    def plan(self, spec: JobSpec, job_id: int, attempt: int) -> LaunchPlan[None]:
        argv = [sys.executable, "-c", f"print('toy job {job_id} attempt {attempt}')"]
        return LaunchPlan(self.name, job_id, attempt, argv, {}, "/", "/tmp")

    def bind_gpus(self, plan: LaunchPlan[None], gpus: Sequence[int]) -> LaunchPlan[None]:
        self.bound.append(tuple(gpus))
        return plan

    def start(self, plan: LaunchPlan[None]) -> str:
        proc = subprocess.Popen(plan.argv, stdout=subprocess.DEVNULL)
        self.procs[str(proc.pid)] = proc
        return str(proc.pid)

    def poll(self, handle: str) -> RunStatus:
        code = self.procs[handle].poll()
        if code is None:
            return RunStatus(RunPhase.RUNNING)
        if code == 0:
            return RunStatus(RunPhase.SUCCEEDED, exit_code=0)
        return RunStatus(RunPhase.FAILED, f"exit code {code}", exit_code=code)

    def cancel(self, handle: str) -> None:
        proc = self.procs[handle]
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def toy_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy's one row: its traits, including where its class lives."""
    toy_traits = launchers.Traits(
        host_gpus=False, detached=False, adopts=False, multi_node=False, title="toy",
        implementation=f"{__name__}:ToyLauncher",
    )  # fmt: skip
    monkeypatch.setitem(launchers.LAUNCHER_TRAITS, TOY, toy_traits)


@pytest.mark.usefixtures("toy_registered")
def test_a_toy_launcher_runs_a_job_to_success(settings: Settings, db: Database) -> None:
    launcher = registry.make_launcher(TOY, settings)
    assert isinstance(launcher, ToyLauncher), "make_launcher builds the class of the row"
    records = DatabaseRecords(db, "toy-w", launcher.name, settings.lease_s)
    loop = WorkerLoop(settings, records, launcher, host="h", pid=1, gpus=[0])
    assert not loop.host_gpus, "the loop reads host_gpus from the toy's traits row"
    with db.session() as s:
        job, _ = jobs.submit_job(
            s, JobSpec(name="toy", task="regression", launcher=TOY), owner="local"
        )
    loop.tick()
    proc = next(iter(launcher.procs.values()))
    proc.wait(timeout=30)
    loop.tick()
    with db.session(write=False) as s:
        done = jobs.get_job(s, job.id)
        assert (done.state, done.attempt, done.worker_id) == ("succeeded", 1, "toy-w"), (
            "the toy's job must end succeeded on its first attempt"
        )
        assert done.scheduler_job_id is None, "an attached launcher records no scheduler id"
    assert launcher.bound == [], "no host GPUs are bound for a launcher without host_gpus"
    loop.shutdown()
