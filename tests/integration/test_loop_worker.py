"""WorkerLoop on a real database (SQLite and PostgreSQL) with a scripted launcher.

The launcher is a fake of our own ``Launcher`` interface (its real implementation is tested
in test_local_launcher_procs.py); everything else — claims, transitions, heartbeats,
events — is the real service code on real databases.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from sqlalchemy import update

from service.core.config import Settings
from service.core.errors import DatabaseUnavailableError
from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs import crud as jobs
from service.store.jobs.crud import Transition
from service.store.models import Job, Worker, utcnow
from service.store.workers import leases
from tests.db_records import DatabaseRecords
from worker.errors import LaunchError
from worker.launchers.base import LaunchPlan, RunPhase, RunStatus
from worker.loop import WorkerLoop

UNREACHABLE_URL = "postgresql+psycopg://postgres@127.0.0.1:1/none?connect_timeout=1"


@dataclass
class ScriptedLauncher:
    """Starts nothing; reports whatever the test sets per job id."""

    name: str = "local"
    phases: dict[str, RunStatus] = field(default_factory=dict)  # by handle "<job>.<attempt>"
    started: list[LaunchPlan] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    fail_start: bool = False

    def plan(self, spec: JobSpec, job_id: int, attempt: int) -> LaunchPlan:
        env = {"CUDA_VISIBLE_DEVICES": ""}
        return LaunchPlan(self.name, job_id, attempt, ["true"], env, "/", "/tmp")

    def bind_gpus(self, plan: LaunchPlan, gpus: Sequence[int]) -> LaunchPlan:
        env = {**plan.env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
        return replace(plan, env=env)

    def start(self, plan: LaunchPlan) -> str:
        if self.fail_start:
            raise LaunchError("no torchrun here")
        self.started.append(plan)
        return f"{plan.job_id}.{plan.attempt}"

    def poll(self, handle: str) -> RunStatus:
        if handle in self.phases:
            return self.phases[handle]
        if handle in self.cancelled:
            return RunStatus(RunPhase.CANCELLED, "cancelled")
        return RunStatus(RunPhase.RUNNING)

    def cancel(self, handle: str) -> None:
        if handle not in self.cancelled:
            self.cancelled.append(handle)


def _submit(db: Database, **spec: object) -> int:
    data = {"name": "t", "task": "regression", **spec}
    with db.session() as s:
        job, _ = jobs.submit_job(s, JobSpec.model_validate(data), owner="local")
        return job.id


def _job(db: Database, job_id: int) -> Job:
    with db.session(write=False) as s:
        return jobs.get_job(s, job_id)


def _reasons(db: Database, job_id: int) -> list[tuple[str | None, str, str | None]]:
    with db.session(write=False) as s:
        return [(e.from_state, e.to_state, e.reason) for e in jobs.list_events(s, job_id)]


def _loop(settings: Settings, db: Database, launcher: ScriptedLauncher, **kw: object) -> WorkerLoop:
    records = DatabaseRecords(db, "w-test", launcher.name, settings.lease_s)
    return WorkerLoop(
        settings,
        records,
        launcher,
        host="h",
        pid=1,
        **kw,  # type: ignore[arg-type]
    )


def _use_db(loop: WorkerLoop, db: Database) -> None:
    """Point the loop's records at ``db`` (e.g. one that cannot be reached)."""
    assert isinstance(loop.records, DatabaseRecords)
    loop.records = replace(loop.records, db=db)


def test_job_runs_to_success(settings: Settings, db: Database) -> None:
    launcher = ScriptedLauncher()
    loop = _loop(settings, db, launcher)
    job_id = _submit(db)
    loop.tick()
    assert _job(db, job_id).state == "running"
    assert [(p.job_id, p.attempt) for p in launcher.started] == [(job_id, 1)]
    launcher.phases[f"{job_id}.1"] = RunStatus(RunPhase.SUCCEEDED, exit_code=-6)
    loop.tick()
    job = _job(db, job_id)
    assert job.state == "succeeded" and job.worker_id == "w-test" and job.finished_at
    assert _reasons(db, job_id) == [
        (None, "queued", None),
        ("queued", "starting", "claimed"),
        ("starting", "running", "launched"),
        ("running", "succeeded", "succeeded"),
    ]
    assert loop.runs == {}


def test_failure_is_retried_then_fails(settings: Settings, db: Database) -> None:
    launcher = ScriptedLauncher()
    loop = _loop(settings, db, launcher)
    job_id = _submit(db, max_restarts=1)
    loop.tick()
    failed = RunStatus(RunPhase.FAILED, "rank 1 failed: RuntimeError: boom")
    launcher.phases[f"{job_id}.1"] = failed
    loop.tick()  # attempt 1 fails → queued (retry 1/1) → claimed again as attempt 2
    job = _job(db, job_id)
    assert (job.attempt, job.restarts, job.state) == (2, 1, "running")
    assert ("running", "queued", "retry 1/1: rank 1 failed: RuntimeError: boom") in _reasons(
        db, job_id
    )
    launcher.phases[f"{job_id}.2"] = failed
    loop.tick()
    job = _job(db, job_id)
    assert (job.state, job.attempt, job.restarts) == ("failed", 2, 1)
    assert job.error == "rank 1 failed: RuntimeError: boom"


def test_preemption_requeues_without_counting(settings: Settings, db: Database) -> None:
    launcher = ScriptedLauncher()
    loop = _loop(settings, db, launcher)
    job_id = _submit(db, max_restarts=0)
    loop.tick()
    launcher.phases[f"{job_id}.1"] = RunStatus(RunPhase.PREEMPTED)
    loop.tick()
    job = _job(db, job_id)
    assert (job.attempt, job.restarts) == (2, 0)
    assert ("running", "queued", "preempted") in _reasons(db, job_id)


def test_cancel_request_stops_the_processes(settings: Settings, db: Database) -> None:
    launcher = ScriptedLauncher()
    loop = _loop(settings, db, launcher)
    job_id = _submit(db)
    loop.tick()
    with db.session() as s:
        jobs.cancel_job(s, job_id)
    loop.tick()
    assert launcher.cancelled == [f"{job_id}.1"]
    assert _job(db, job_id).state == "cancelled"
    assert _reasons(db, job_id)[-1] == ("running", "cancelled", "cancel requested")


def test_job_taken_away_is_stopped(settings: Settings, db: Database) -> None:
    launcher = ScriptedLauncher()
    loop = _loop(settings, db, launcher)
    job_id = _submit(db)
    loop.tick()
    with db.session() as s:  # e.g. a reaper decided this worker was lost
        jobs.apply_transition(s, Transition(job_id, JobState.RUNNING, JobState.QUEUED, "x"))
    loop.tick()
    assert launcher.cancelled == [f"{job_id}.1"]
    assert [(p.job_id, p.attempt) for p in launcher.started] == [(job_id, 1), (job_id, 2)]
    assert loop.runs[job_id].attempt == 2


def test_slots_and_gpu_pool_limit_claims(settings: Settings, db: Database) -> None:
    launcher = ScriptedLauncher()
    loop = _loop(settings, db, launcher, slots=3, gpus=[0, 1])
    gpu_jobs = [_submit(db, resources={"gpus_per_node": 1}) for _ in range(3)]
    loop.tick()
    assert sorted(p.job_id for p in launcher.started) == gpu_jobs[:2]
    visible = sorted(p.env["CUDA_VISIBLE_DEVICES"] for p in launcher.started)
    assert visible == ["0", "1"], "each job gets its own GPU from the pool"
    cpu_job = _submit(db)
    loop.tick()
    assert launcher.started[-1].job_id == cpu_job, "a CPU job fits the third slot"
    assert _job(db, gpu_jobs[2]).state == "queued"
    launcher.phases[f"{gpu_jobs[0]}.1"] = RunStatus(RunPhase.SUCCEEDED)
    loop.tick()  # its GPU is back in the pool: the third GPU job starts
    assert launcher.started[-1].job_id == gpu_jobs[2]
    assert (
        launcher.started[-1].env["CUDA_VISIBLE_DEVICES"]
        == launcher.started[0].env["CUDA_VISIBLE_DEVICES"]
    )


def test_launch_failure_fails_the_job_not_the_worker(settings: Settings, db: Database) -> None:
    launcher = ScriptedLauncher(fail_start=True)
    loop = _loop(settings, db, launcher)
    job_id = _submit(db)
    loop.tick()
    job = _job(db, job_id)
    assert job.state == "failed"
    assert job.error == "launch failed: LaunchError: no torchrun here"


def test_shutdown_requeues_running_jobs(settings: Settings, db: Database) -> None:
    launcher = ScriptedLauncher()
    loop = _loop(settings, db, launcher, slots=2)
    requeued, finished = _submit(db, max_restarts=0), _submit(db)
    loop.tick()
    launcher.phases[f"{finished}.1"] = RunStatus(RunPhase.SUCCEEDED)  # ended before we stopped it
    loop.shutdown()
    job = _job(db, requeued)
    assert (job.state, job.attempt, job.restarts, job.worker_id) == ("queued", 2, 0, None)
    assert _reasons(db, requeued)[-1] == ("running", "queued", "worker stopped")
    assert _job(db, finished).state == "succeeded"
    assert f"{requeued}.1" in launcher.cancelled
    with db.session(write=False) as s:
        worker = s.get(Worker, "w-test")
        assert worker is not None and worker.stopped_at is not None


def test_stale_transition_is_logged_not_fatal(
    settings: Settings, db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    launcher = ScriptedLauncher()
    loop = _loop(settings, db, launcher)
    job_id = _submit(db)
    loop.tick()
    with db.session() as s:  # someone else ends it behind the worker's back
        jobs.apply_transition(s, Transition(job_id, JobState.RUNNING, JobState.FAILED, "x"))
    launcher.phases[f"{job_id}.1"] = RunStatus(RunPhase.SUCCEEDED)
    with caplog.at_level(logging.WARNING, logger="worker.loop"):
        loop._watch(loop.runs[job_id])
    assert "no longer running" in caplog.text
    loop.tick()  # the heartbeat no longer lists it: forgotten
    assert loop.runs == {} and _job(db, job_id).state == "failed"


def test_orphaned_held_job_is_requeued(settings: Settings, db: Database) -> None:
    launcher = ScriptedLauncher()
    loop = _loop(settings, db, launcher)
    loop.register()
    job_id = _submit(db)
    with db.session() as s:  # held in the database, but this loop never launched it
        claims.claim_next_job(
            s, worker_id="w-test", launcher="local", max_gpus_per_node=0, lease_s=60
        )
    loop.tick()
    assert ("starting", "queued", "held by this worker but not running here") in _reasons(
        db, job_id
    )


def test_database_outage_is_survived(settings: Settings, db: Database) -> None:
    launcher = ScriptedLauncher()
    loop = _loop(settings, db, launcher)
    job_id = _submit(db)
    loop.tick()
    down = Database.from_url(UNREACHABLE_URL)
    _use_db(loop, down)
    with pytest.raises(DatabaseUnavailableError):
        loop.tick()
    stop = threading.Event()
    thread = threading.Thread(target=loop.run, args=(stop,))
    thread.start()
    try:
        time.sleep(1.5)  # ticks fail and back off; the job's processes are left alone
        assert thread.is_alive() and launcher.cancelled == []
        _use_db(loop, db)
        launcher.phases[f"{job_id}.1"] = RunStatus(RunPhase.SUCCEEDED)
        deadline = time.monotonic() + 30
        while _job(db, job_id).state != "succeeded" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _job(db, job_id).state == "succeeded", "the loop should recover after the outage"
    finally:
        stop.set()
        thread.join(30)
        down.dispose()
    assert not thread.is_alive()


def test_cancel_just_before_shutdown_ends_cancelled(settings: Settings, db: Database) -> None:
    """The API accepts a cancel after the worker's last heartbeat, then the worker stops: the
    job ends cancelled, not requeued ("worker stopped") with the request dropped."""
    launcher = ScriptedLauncher()
    loop = _loop(settings, db, launcher)
    job_id = _submit(db)
    loop.tick()
    with db.session() as s:
        jobs.cancel_job(s, job_id)
    assert not loop.runs[job_id].cancel_requested, "the loop must not have seen it yet"
    loop.shutdown()
    job = _job(db, job_id)
    assert (job.state, job.attempt) == ("cancelled", 1)
    assert _reasons(db, job_id)[-1] == (
        "running",
        "cancelled",
        "cancel requested (instead of: worker stopped)",
    )


@pytest.mark.parametrize(
    ("phase", "instead_of"),
    [
        (RunPhase.FAILED, "retry 1/1: boom"),
        (RunPhase.PREEMPTED, "preempted: boom"),
    ],
)
def test_cancel_unseen_by_the_loop_beats_a_relaunch(
    settings: Settings, db: Database, phase: RunPhase, instead_of: str
) -> None:
    launcher = ScriptedLauncher()
    loop = _loop(settings, db, launcher)
    job_id = _submit(db, max_restarts=1)
    loop.tick()
    with db.session() as s:
        jobs.cancel_job(s, job_id)
    launcher.phases[f"{job_id}.1"] = RunStatus(phase, "boom")
    loop._watch(loop.runs[job_id])  # before any heartbeat told the loop of the cancel
    assert loop.runs == {}
    job = _job(db, job_id)
    assert (job.state, job.attempt, job.restarts) == ("cancelled", 1, 0)
    assert _reasons(db, job_id)[-1][2] == f"cancel requested (instead of: {instead_of})"
    loop.tick()
    assert [p.attempt for p in launcher.started] == [1], "a cancelled job was launched again"


def _run_in_thread(loop: WorkerLoop) -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()
    thread = threading.Thread(target=loop.run, args=(stop,), daemon=True)
    thread.start()
    return stop, thread


def _wait(cond: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.05)


def test_requeued_during_an_outage_stops_the_stale_attempt(
    settings: Settings, db: Database
) -> None:
    """Another worker's reaper requeued the job while this worker could not reach the
    database: once it can, this worker stops attempt 1's processes (and may run attempt 2)."""
    launcher = ScriptedLauncher()
    loop = _loop(settings, db, launcher)
    job_id = _submit(db)
    loop.tick()
    down = Database.from_url(UNREACHABLE_URL)
    _use_db(loop, down)
    stop, thread = _run_in_thread(loop)
    try:
        time.sleep(0.5)
        with db.session() as s:  # the lease ran out meanwhile; a reaper elsewhere requeues it
            s.execute(update(Job).where(Job.id == job_id).values(lease_expires_at=utcnow()))
        with db.session() as s:
            assert [t.job_id for t in leases.requeue_expired_jobs(s)] == [job_id]
        assert launcher.cancelled == [], "nothing may be stopped while the database is down"
        _use_db(loop, db)
        _wait(lambda: f"{job_id}.1" in launcher.cancelled, 30, "attempt 1 to be stopped")
        _wait(lambda: len(launcher.started) == 2, 30, "attempt 2 to be launched")
        assert [(p.job_id, p.attempt) for p in launcher.started] == [(job_id, 1), (job_id, 2)]
        assert thread.is_alive()
    finally:
        stop.set()
        thread.join(30)
        down.dispose()


def test_outage_shorter_than_the_fence_keeps_the_job(db: Database, tmp_path: Path) -> None:
    """Backoff never exceeds a quarter of the lease, nor sleeps past the fence deadline
    (lease 8 s − stop budget 4 s): after an outage shorter than that the worker renews its
    leases before they run out, so nothing is stopped and no reaper requeues its job."""
    settings = Settings(
        home=tmp_path, database_url="sqlite://", heartbeat_interval_s=0.2, lease_s=8
    )
    launcher = ScriptedLauncher()
    loop = _loop(settings, db, launcher)
    assert loop.stop_budget_s == 4.0
    job_id = _submit(db)
    loop.tick()
    down = Database.from_url(UNREACHABLE_URL)
    _use_db(loop, down)
    stop, thread = _run_in_thread(loop)
    try:
        time.sleep(2.0)  # ticks fail at ~0, 0.2, 0.6, 1.4; the next (~3.0) gets through
        _use_db(loop, db)
        deadline = time.monotonic() + 6.5  # past the lease of the last heartbeat before
        while time.monotonic() < deadline:
            with db.session() as s:  # another worker's reaper, every 0.1 s
                assert leases.requeue_expired_jobs(s) == [], "the lease ran out: job requeued"
            time.sleep(0.1)
        job = _job(db, job_id)
        assert (job.state, job.attempt) == ("running", 1)
        assert launcher.cancelled == []
    finally:
        stop.set()
        thread.join(30)
        down.dispose()


def test_outage_longer_than_the_fence_stops_the_ranks_before_the_lease_lapses(
    db: Database, tmp_path: Path
) -> None:
    """With the database out of reach past the fence deadline (lease 6 s − stop budget
    3 s), the worker stops the job's ranks while its lease still holds (no reaper could have
    requeued it yet); once the database answers, it requeues the job (still held here) and
    runs attempt 2."""
    settings = Settings(
        home=tmp_path, database_url="sqlite://", heartbeat_interval_s=0.2, lease_s=6
    )
    launcher = ScriptedLauncher()
    loop = _loop(settings, db, launcher)
    job_id = _submit(db)
    loop.tick()
    down = Database.from_url(UNREACHABLE_URL)
    _use_db(loop, down)
    stop, thread = _run_in_thread(loop)
    try:
        _wait(lambda: f"{job_id}.1" in launcher.cancelled, 30, "the fence to stop attempt 1")
        with db.session() as s:  # another worker's reaper, right after the stop
            assert leases.requeue_expired_jobs(s) == [], "stopped only after the lease lapsed"
        assert loop.runs == {}
        _use_db(loop, db)
        _wait(lambda: len(launcher.started) == 2, 30, "attempt 2 to be launched")
        assert [(p.job_id, p.attempt) for p in launcher.started] == [(job_id, 1), (job_id, 2)]
        assert ("running", "queued", "held by this worker but not running here") in _reasons(
            db, job_id
        )
        assert launcher.cancelled == [f"{job_id}.1"], "attempt 1 stopped once, 2 left alone"
    finally:
        stop.set()
        thread.join(30)
        down.dispose()


def test_a_tick_that_raises_does_not_end_the_worker(
    settings: Settings, db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    launcher = BrokenOnceLauncher()
    loop = _loop(settings, db, launcher)
    job_id = _submit(db)
    with caplog.at_level(logging.ERROR, logger="worker.loop"):
        stop, thread = _run_in_thread(loop)
        try:
            _wait(lambda: launcher.broke, 30, "a poll to raise")
            launcher.phases[f"{job_id}.1"] = RunStatus(RunPhase.SUCCEEDED)
            _wait(lambda: _job(db, job_id).state == "succeeded", 30, "the job to succeed")
            assert thread.is_alive()
        finally:
            stop.set()
            thread.join(30)
    assert "worker tick failed" in caplog.text


@dataclass
class BrokenOnceLauncher(ScriptedLauncher):
    """Its first poll raises (a launcher bug, a full /proc, ...)."""

    broke: bool = False

    def poll(self, handle: str) -> RunStatus:
        if not self.broke:
            self.broke = True
            raise RuntimeError("poll broke")
        return super().poll(handle)


def test_idle_pause_claims_a_job_submitted_meanwhile(settings: Settings, db: Database) -> None:
    """A job submitted between ticks starts during the pause (claim poll), not at the next
    tick; a job that does not fit (another launcher, too many GPUs) is not even tried."""
    launcher = ScriptedLauncher()
    loop = _loop(settings, db, launcher, slots=2)
    loop.tick()
    stop = threading.Event()
    pause = threading.Thread(target=loop._pause, args=(stop, 120.0), daemon=True)
    pause.start()
    misfit = _submit(db, launcher="slurm")
    job_id = _submit(db)
    deadline = time.monotonic() + 30
    while _job(db, job_id).state != "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pause.is_alive(), "the job must start inside the 120 s pause, before any tick"
    assert _job(db, job_id).state == "running"
    assert [p.job_id for p in launcher.started] == [job_id]
    assert _job(db, misfit).state == "queued"
    stop.set()
    pause.join(5)
    assert not pause.is_alive(), "stop must end the pause at once"


def test_the_claimable_count_matches_the_claim(settings: Settings, db: Database) -> None:
    with db.session(write=False) as s:
        assert not claims.count_claimable_jobs(s, launcher="local", max_gpus_per_node=0, limit=1)
    _submit(db, resources={"gpus_per_node": 2})
    with db.session(write=False) as s:
        assert not claims.count_claimable_jobs(s, launcher="local", max_gpus_per_node=1, limit=1)
        assert claims.count_claimable_jobs(s, launcher="local", max_gpus_per_node=2, limit=1)
        assert not claims.count_claimable_jobs(s, launcher="slurm", max_gpus_per_node=8, limit=1)
