"""WorkerLoop with a launcher that starts arrays (Slurm's ``ArrayStarter``), on real SQLite and
PostgreSQL: a sweep's trials are claimed in batches within max_concurrent and started as one
array per batch, each trial following its own element; a plain job still starts alone; a
refused array fails its own trials only, and the worker goes on.

The launcher is a fake of our own interfaces (``Launcher``, ``ArrayStarter``,
``BatchPoller``), named "slurm" for its traits; the real one runs in tests/slurm/.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select

from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.core.sweeps.spec import SweepSpec, plan_trials, resolve_objective
from service.store.db import Database
from service.store.jobs import crud as jobs
from service.store.models import Job
from service.store.sweeps import crud as sweeps
from tests.db_records import DatabaseRecords
from worker.launchers.base import ArrayPlan, LaunchPlan, RunPhase, RunStatus
from worker.loop import WorkerLoop

BASE = {"task": "regression", "launcher": "slurm", "training": {"max_steps": 5}}


@dataclass
class FakeArraySlurm:
    """Jobs and array elements "run" in ``backend``; records what the loop asked."""

    backend: dict[str, RunStatus] = field(default_factory=dict)
    name: str = "slurm"
    next_id: int = 100
    refuse_arrays: bool = False
    singles: list[int] = field(default_factory=list)  # job ids started alone
    arrays: list[tuple[list[int], int]] = field(default_factory=list)  # (job ids, parallelism)

    def plan(self, spec: JobSpec, job_id: int, attempt: int) -> LaunchPlan[Any]:
        return LaunchPlan(self.name, job_id, attempt, ["sbatch"], {}, "/", "/tmp")

    def bind_gpus(self, plan: LaunchPlan[Any], gpus: Sequence[int]) -> LaunchPlan[Any]:
        return plan

    def start(self, plan: LaunchPlan[Any]) -> str:
        self.next_id += 1
        self.singles.append(plan.job_id)
        self.backend[str(self.next_id)] = RunStatus(RunPhase.RUNNING)
        return str(self.next_id)

    def plan_array(
        self, plans: Sequence[LaunchPlan[Any]], *, parallelism: int | None
    ) -> list[ArrayPlan[Any]]:
        n = len(plans)
        return [ArrayPlan(self.name, tuple(plans), min(parallelism or n, n), script="#!")]

    def start_array(self, plan: ArrayPlan[Any]) -> list[str]:
        if self.refuse_arrays:
            raise RuntimeError("sbatch: error: Batch job submission failed")
        self.next_id += 1
        self.arrays.append(([e.job_id for e in plan.elements], plan.parallelism))
        handles = [f"{self.next_id}_{i}" for i in range(len(plan.elements))]
        for handle in handles:
            self.backend[handle] = RunStatus(RunPhase.RUNNING)
        return handles

    def poll(self, handle: str) -> RunStatus:
        return self.backend.get(handle, RunStatus(RunPhase.PENDING))

    def poll_many(self, handles: list[str]) -> dict[str, RunStatus]:
        return {h: self.poll(h) for h in handles}

    def cancel(self, handle: str) -> None:
        self.backend[handle] = RunStatus(RunPhase.CANCELLED, "cancelled")


def _sweep(db: Database, settings: Settings, n: int, max_concurrent: int | None) -> list[int]:
    spec = SweepSpec.model_validate({
        "name": "s", "base": BASE, "max_concurrent": max_concurrent,
        "axes": {"training.lr": {"grid": [0.001 * (i + 1) for i in range(n)]}},
    })  # fmt: skip
    planned = plan_trials(spec, settings.model_copy(update={"slurm_enabled": True}))
    with db.session() as s:
        sweep_id = sweeps.submit_sweep(s, spec, resolve_objective(spec), planned, owner="t").id
    with db.session(write=False) as s:
        return list(s.scalars(select(Job.id).where(Job.sweep_id == sweep_id).order_by(Job.id)))


def _job(db: Database, job_id: int) -> Job:
    with db.session(write=False) as s:
        job = jobs.get_job(s, job_id)
        s.expunge(job)
        return job


def _active(db: Database, job_ids: list[int]) -> int:
    return sum(_job(db, j).state in ("starting", "running") for j in job_ids)


def _loop(settings: Settings, db: Database, launcher: FakeArraySlurm, slots: int) -> WorkerLoop:
    records = DatabaseRecords(db, "w", launcher.name, settings.lease_s)
    return WorkerLoop(settings, records, launcher, host="h", pid=1, slots=slots)  # type: ignore[arg-type]


def test_trials_start_as_arrays_within_max_concurrent(settings: Settings, db: Database) -> None:
    trials = _sweep(db, settings, 5, max_concurrent=2)
    with db.session() as s:
        plain, _ = jobs.submit_job(s, JobSpec.model_validate({"name": "p", **BASE}), owner="t")
    launcher = FakeArraySlurm()
    loop = _loop(settings, db, launcher, slots=8)
    loop.tick()
    assert launcher.arrays == [(trials[:2], 2)], "one array of the two trials max_concurrent allows"
    assert launcher.singles == [plain.id], "a plain job starts alone"
    first, second = (_job(db, j) for j in trials[:2])
    assert (first.scheduler_job_id, second.scheduler_job_id) == ("101_0", "101_1")
    assert (first.state, second.state) == ("running", "running")
    assert _active(db, trials) == 2

    ended = 0
    while ended < len(trials):  # finish one element a tick: the next trial takes its place
        running = [j for j in trials if _job(db, j).state == "running"]
        launcher.backend[str(_job(db, running[0]).scheduler_job_id)] = RunStatus(RunPhase.SUCCEEDED)
        loop.tick()
        ended += 1
        assert _active(db, trials) <= 2
    assert [_job(db, j).state for j in trials] == ["succeeded"] * 5
    assert [ids for ids, _ in launcher.arrays] == [trials[:2], [trials[2]], [trials[3]],
                                                   [trials[4]]]  # fmt: skip


def test_a_refused_array_fails_its_trials_and_the_worker_goes_on(
    settings: Settings, db: Database
) -> None:
    trials = _sweep(db, settings, 3, max_concurrent=None)
    launcher = FakeArraySlurm(refuse_arrays=True)
    loop = _loop(settings, db, launcher, slots=2)
    loop.tick()  # every batch it claims is refused: each trial fails, the loop goes on
    assert [_job(db, j).state for j in trials] == [JobState.FAILED] * 3
    assert all("Batch job submission failed" in (_job(db, j).error or "") for j in trials)
    assert launcher.arrays == [] and loop.runs == {}
    with db.session() as s:
        plain, _ = jobs.submit_job(s, JobSpec.model_validate({"name": "p", **BASE}), owner="t")
    loop.tick()
    assert _job(db, plain.id).state == "running", "the worker still starts jobs"
