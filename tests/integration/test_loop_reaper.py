"""requeue_expired_jobs (run by every worker's loop): lost workers' jobs go back to the queue."""

from __future__ import annotations

import time

from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs import crud as jobs
from service.store.jobs.crud import Transition
from service.store.models import Job
from service.store.workers import leases
from service.store.workers.leases import WORKER_LOST_REASON, heartbeat
from service.store.workers.registry import register_worker


def _claimed(db: Database, worker_id: str, lease_s: float, launcher: str = "local") -> int:
    spec = JobSpec(name="t", task="regression", launcher=launcher)  # type: ignore[arg-type]
    with db.session() as s:
        job, _ = jobs.submit_job(s, spec, owner="local")
        job_id = job.id
    with db.session() as s:
        register_worker(
            s, worker_id=worker_id, host="h", pid=1, launcher=launcher, capacity={"slots": 1}
        )
        claimed = claims.claim_next_job(
            s, worker_id=worker_id, launcher=launcher, max_gpus_per_node=0, lease_s=lease_s
        )
        assert claimed is not None and claimed.id == job_id
    return job_id


def test_expired_lease_requeues_without_counting_a_restart(db: Database) -> None:
    lost = _claimed(db, "lost", lease_s=0.01)
    with db.session() as s:
        jobs.apply_transition(s, Transition(lost, JobState.STARTING, JobState.RUNNING, "x"))
    alive = _claimed(db, "alive", lease_s=60)
    time.sleep(0.05)
    with db.session() as s:
        reaped = leases.requeue_expired_jobs(s)
    assert reaped == [Transition(lost, JobState.RUNNING, JobState.QUEUED, WORKER_LOST_REASON)]
    with db.session(write=False) as s:
        job = s.get(Job, lost)
        assert job is not None
        assert (job.state, job.attempt, job.restarts, job.worker_id) == ("queued", 2, 0, None)
        events = jobs.list_events(s, lost)
        assert (events[-1].to_state, events[-1].reason, events[-1].attempt) == (
            "queued",
            WORKER_LOST_REASON,
            2,
        )
        other = s.get(Job, alive)
        assert other is not None and other.state == "starting", "a live lease is left alone"
    with db.session() as s:  # the lost worker comes back: the job is no longer its own
        assert heartbeat(s, "lost", lease_s=30) == []
    with db.session() as s:
        assert leases.requeue_expired_jobs(s) == [], "reaping is idempotent"


def test_submitted_slurm_jobs_are_left_for_a_slurm_worker_to_adopt(db: Database) -> None:
    """A Slurm job keeps running without its worker: requeueing it would start a second copy
    as attempt + 1. Only a Slurm job not yet submitted (no scheduler_job_id) is requeued."""
    on_slurm = _claimed(db, "lost-slurm", lease_s=0.01, launcher="slurm")
    not_submitted = _claimed(db, "lost-slurm", lease_s=0.01, launcher="slurm")
    with db.session() as s:
        jobs.apply_transition(s, Transition(on_slurm, JobState.STARTING, JobState.RUNNING, "x"))
        jobs.set_scheduler_job_id(s, on_slurm, 1, "4242")
    time.sleep(0.05)
    with db.session() as s:
        reaped = leases.requeue_expired_jobs(s)
    assert reaped == [
        Transition(not_submitted, JobState.STARTING, JobState.QUEUED, WORKER_LOST_REASON)
    ], "only the Slurm job without a scheduler_job_id may be requeued"
    with db.session(write=False) as s:
        job = s.get(Job, on_slurm)
        assert job is not None
        assert (job.state, job.attempt, job.worker_id, job.scheduler_job_id) == (
            "running",
            1,
            "lost-slurm",
            "4242",
        ), "a submitted Slurm job must keep its attempt, holder and Slurm id for adoption"


def test_lost_job_with_a_cancel_request_ends_cancelled(db: Database) -> None:
    """The worker died after the API accepted a cancel: the reaper cancels the job instead of
    requeueing it (a requeue would drop the request and run it again)."""
    lost = _claimed(db, "lost", lease_s=0.01)
    with db.session() as s:
        jobs.apply_transition(s, Transition(lost, JobState.STARTING, JobState.RUNNING, "x"))
        assert jobs.cancel_job(s, lost).cancel_requested
    time.sleep(0.05)
    reason = f"cancel requested (instead of: {WORKER_LOST_REASON})"
    with db.session() as s:
        reaped = leases.requeue_expired_jobs(s)
    assert reaped == [Transition(lost, JobState.RUNNING, JobState.CANCELLED, reason)]
    with db.session(write=False) as s:
        job = s.get(Job, lost)
        assert job is not None
        assert (job.state, job.attempt, job.finished_at is not None) == ("cancelled", 1, True)
        last = jobs.list_events(s, lost)[-1]
        assert (last.from_state, last.to_state, last.reason) == ("running", "cancelled", reason)
    with db.session() as s:
        register_worker(s, worker_id="new", host="h", pid=2, launcher="local", capacity={})
        assert (
            claims.claim_next_job(
                s, worker_id="new", launcher="local", max_gpus_per_node=0, lease_s=60
            )
            is None
        ), "a cancelled job must not be claimed again"
