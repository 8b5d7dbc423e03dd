"""requeue_expired_jobs (run by every worker's loop): lost workers' jobs go back to the queue."""

from __future__ import annotations

import time

from service import jobs
from service.db import Database
from service.jobs import WORKER_LOST_REASON, Transition
from service.models import Job
from service.spec import JobSpec
from service.states import JobState
from service.workers import heartbeat, register_worker


def _claimed(db: Database, worker_id: str, lease_s: float) -> int:
    with db.session() as s:
        job, _ = jobs.submit_job(s, JobSpec(name="t", task="regression"), owner="local")
        job_id = job.id
    with db.session() as s:
        register_worker(
            s, worker_id=worker_id, host="h", pid=1, launcher="local", capacity={"slots": 1}
        )
        claimed = jobs.claim_next_job(
            s, worker_id=worker_id, launcher="local", max_gpus_per_node=0, lease_s=lease_s
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
        reaped = jobs.requeue_expired_jobs(s)
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
        assert jobs.requeue_expired_jobs(s) == [], "reaping is idempotent"
