"""WorkerLoop with a detached launcher (Slurm's behaviour) on real SQLite and PostgreSQL:
adoption of jobs whose worker is gone, clean shutdown that leaves jobs running, one batched
poll per tick, and a job adopted elsewhere that must not be cancelled.

The launcher is a fake of our own ``Launcher`` interface that behaves like ``SlurmLauncher``
where the loop can tell (its name, hence the "slurm" row of the traits table: ``detached``,
``adopts``; ``poll_many``; handles that any instance can poll); the real one runs against real
Slurm in tests/slurm/.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from sqlalchemy import update

from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.store.db import Database
from service.store.jobs import crud as jobs
from service.store.jobs.crud import Transition
from service.store.models import Job, Worker, utcnow
from service.store.workers.registry import register_worker
from tests.db_records import DatabaseRecords
from worker.launchers.base import LaunchPlan, RunPhase, RunStatus
from worker.loop import WorkerLoop


@dataclass
class FakeSlurm:
    """Jobs "run in the backend": their phases live in ``backend``, shared by every instance
    (as Slurm is shared by every worker). Records what the loop asked of it."""

    backend: dict[str, RunStatus]
    db: Database
    name: str = "slurm"
    next_id: int = 1000
    cancelled: list[str] = field(default_factory=list)
    polled: list[str] = field(default_factory=list)  # single polls
    batches: list[list[str]] = field(default_factory=list)  # poll_many calls

    def plan(self, spec: JobSpec, job_id: int, attempt: int) -> LaunchPlan:
        return LaunchPlan(self.name, job_id, attempt, ["sbatch"], {}, "/", "/tmp")

    def bind_gpus(self, plan: LaunchPlan, gpus: Sequence[int]) -> LaunchPlan:
        return plan

    def start(self, plan: LaunchPlan) -> str:
        self.next_id += 1
        handle = str(self.next_id)
        self.backend[handle] = RunStatus(RunPhase.RUNNING)
        return handle  # the loop records it as the job's scheduler_job_id

    def poll(self, handle: str) -> RunStatus:
        self.polled.append(handle)
        return self.backend.get(handle, RunStatus(RunPhase.PENDING))

    def poll_many(self, handles: list[str]) -> dict[str, RunStatus]:
        self.batches.append(sorted(handles))
        return {h: self.backend.get(h, RunStatus(RunPhase.PENDING)) for h in handles}

    def cancel(self, handle: str) -> None:
        self.cancelled.append(handle)
        self.backend[handle] = RunStatus(RunPhase.CANCELLED, "cancelled")


def _submit(db: Database, **spec: object) -> int:
    data = {"name": "t", "task": "regression", "launcher": "slurm", **spec}
    with db.session() as s:
        job, _ = jobs.submit_job(s, JobSpec.model_validate(data), owner="local")
        return job.id


def _job(db: Database, job_id: int) -> Job:
    with db.session(write=False) as s:
        job = jobs.get_job(s, job_id)
        s.expunge(job)
        return job


def _loop(
    settings: Settings, db: Database, launcher: FakeSlurm, worker_id: str, **kw: int
) -> WorkerLoop:
    records = DatabaseRecords(db, worker_id, launcher.name, settings.lease_s)
    return WorkerLoop(settings, records, launcher, host="h", pid=1, **kw)  # type: ignore[arg-type]


def test_clean_shutdown_leaves_the_job_running_and_the_next_worker_adopts_it(
    settings: Settings, db: Database
) -> None:
    backend: dict[str, RunStatus] = {}
    first = FakeSlurm(backend, db)
    a = _loop(settings, db, first, "a")
    job_id = _submit(db, max_restarts=2)
    a.tick()
    handle = _job(db, job_id).scheduler_job_id
    assert handle and _job(db, job_id).state == "running"
    a.shutdown()
    job = _job(db, job_id)
    assert (job.state, job.attempt, job.worker_id) == ("running", 1, "a"), (
        "a detached job must be neither requeued nor ended at a clean shutdown"
    )
    assert first.cancelled == [], "a clean shutdown must not cancel a Slurm job"
    with db.session(write=False) as s:
        stopped = s.get(Worker, "a")
        assert stopped is not None and stopped.stopped_at is not None

    second = FakeSlurm(backend, db)
    b = _loop(settings, db, second, "b")
    b.tick()  # adopts at once: its worker is marked stopped
    assert set(b.runs) == {job_id}
    run = b.runs[job_id]
    assert (run.handle, run.attempt, run.max_restarts) == (handle, 1, 2)
    assert _job(db, job_id).worker_id == "b"
    assert second.batches == [[handle]], "an adopted job is polled by its handle"
    backend[handle] = RunStatus(RunPhase.SUCCEEDED)
    b.tick()
    job = _job(db, job_id)
    assert (job.state, job.attempt, job.worker_id, job.scheduler_job_id) == (
        "succeeded",
        1,
        "b",
        handle,
    )
    assert b.runs == {}


def test_a_lost_workers_job_is_adopted_not_requeued(settings: Settings, db: Database) -> None:
    backend: dict[str, RunStatus] = {}
    a = _loop(settings, db, FakeSlurm(backend, db), "a")
    job_id = _submit(db)
    a.tick()  # then "a" dies without a word (SIGKILL): its lease runs out
    with db.session() as s:  # set, not waited for: a tiny lease_s raced b's first tick
        s.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(lease_expires_at=utcnow() - timedelta(seconds=1))
        )
    handle = _job(db, job_id).scheduler_job_id
    assert handle
    b = _loop(settings, db, FakeSlurm(backend, db), "b")
    b._next_reap = 0.0  # the reaper runs in b's first tick, after adoption
    b.tick()
    job = _job(db, job_id)
    assert (job.state, job.attempt, job.worker_id, job.scheduler_job_id) == (
        "running",
        1,
        "b",
        handle,
    ), "the Slurm job still runs: it must be adopted as attempt 1, not requeued as attempt 2"
    with db.session(write=False) as s:
        assert [e.to_state for e in jobs.list_events(s, job_id)] == [
            "queued",
            "starting",
            "running",
        ]


def test_one_batched_poll_per_tick(settings: Settings, db: Database) -> None:
    launcher = FakeSlurm({}, db)
    loop = _loop(settings, db, launcher, "a", slots=3)
    ids = [_submit(db) for _ in range(3)]
    loop.tick()
    launcher.polled.clear()
    launcher.batches.clear()
    loop.tick()
    handles = sorted(str(_job(db, i).scheduler_job_id) for i in ids)
    assert launcher.batches == [handles], "all held jobs in one poll_many per tick"
    assert launcher.polled == [], "no per-job polls when the launcher can batch"


def test_a_job_adopted_elsewhere_is_not_cancelled(settings: Settings, db: Database) -> None:
    backend: dict[str, RunStatus] = {}
    launcher = FakeSlurm(backend, db)
    loop = _loop(settings, db, launcher, "a")
    job_id = _submit(db)
    loop.tick()
    with db.session() as s:  # e.g. "a" stalled past its lease and "b" adopted the job
        register_worker(s, worker_id="b", host="h", pid=2, launcher="slurm", capacity={})
        s.execute(update(Job).where(Job.id == job_id).values(worker_id="b"))
    loop.tick()
    assert loop.runs == {} and launcher.cancelled == []
    assert _job(db, job_id).state == "running"
    # A job requeued behind the worker's back is another matter: its Slurm job is stopped.
    other = _submit(db)
    loop.tick()
    with db.session() as s:
        jobs.apply_transition(s, Transition(other, JobState.RUNNING, JobState.QUEUED, "x"))
    handle = next(iter(loop.runs.values())).handle
    loop.tick()
    assert handle in launcher.cancelled
