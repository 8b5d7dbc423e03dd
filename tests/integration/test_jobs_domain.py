"""Domain operations on both databases: compare-and-set transitions, cancel, fencing, ingest."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
from sqlalchemy import delete, update

from service.core.errors import ConflictError, StaleAttemptError, StaleStateError
from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.store.checkpoints import crud as checkpoints
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs import crud as jobs
from service.store.metrics import points as metrics
from service.store.metrics.points import MetricPoint
from service.store.models import Job, utcnow
from service.store.workers import leases
from service.store.workers import registry as workers

SPEC = JobSpec(name="j", task="regression")


def _running_job(db: Database) -> int:
    with db.session() as s:
        job, _ = jobs.submit_job(s, SPEC, owner="o")
        workers.register_worker(s, worker_id="w", host="h", pid=1, launcher="local", capacity={})
    with db.session() as s:
        claimed = claims.claim_next_job(
            s, worker_id="w", launcher="local", max_gpus_per_node=0, lease_s=30
        )
        assert claimed is not None and claimed.id == job.id
        jobs.apply_transition(s, jobs.Transition(job.id, JobState.STARTING, JobState.RUNNING))
    return job.id


def test_transition_is_compare_and_set(db: Database) -> None:
    job_id = _running_job(db)
    with db.session() as s:
        job = jobs.apply_transition(
            s, jobs.Transition(job_id, JobState.RUNNING, JobState.SUCCEEDED, "done")
        )
        assert job.finished_at is not None and job.state == "succeeded"
    with pytest.raises(StaleStateError, match="no longer running"), db.session() as s:
        jobs.apply_transition(s, jobs.Transition(job_id, JobState.RUNNING, JobState.FAILED))
    with db.session(write=False) as s:
        states = [(e.from_state, e.to_state) for e in jobs.list_events(s, job_id)]
        assert states[-1] == ("running", "succeeded")
        assert jobs.get_job(s, job_id).state == "succeeded", "a stale write changed nothing"


def test_idempotency_key_returns_the_same_job(db: Database) -> None:
    with db.session() as s:
        a, created_a = jobs.submit_job(s, SPEC, owner="o", idempotency_key="k1")
    with db.session() as s:
        b, created_b = jobs.submit_job(s, SPEC, owner="o", idempotency_key="k1")
        c, created_c = jobs.submit_job(s, SPEC, owner="other", idempotency_key="k1")
    assert (created_a, created_b, created_c) == (True, False, True)
    assert a.id == b.id != c.id


def test_cancel_queued_started_and_finished(db: Database) -> None:
    with db.session() as s:
        queued, _ = jobs.submit_job(s, SPEC, owner="o")
    with db.session() as s:
        assert jobs.cancel_job(s, queued.id).state == "cancelled"
    running_id = _running_job(db)
    with db.session() as s:
        job = jobs.cancel_job(s, running_id)
        assert (job.state, job.cancel_requested) == ("running", True)
    with db.session() as s:
        assert jobs.cancel_job(s, running_id).cancel_requested, "cancel twice is fine"
    with pytest.raises(ConflictError, match="already cancelled"), db.session() as s:
        jobs.cancel_job(s, queued.id)


def test_writes_from_a_stale_attempt_are_refused(db: Database) -> None:
    job_id = _running_job(db)
    with db.session() as s:
        assert metrics.record_metrics(s, job_id, 1, [MetricPoint("loss", 1, 0.5)]) == 1
        jobs.apply_transition(s, jobs.Transition(job_id, JobState.RUNNING, JobState.QUEUED))
    for write in (
        lambda s: metrics.record_metrics(s, job_id, 1, [MetricPoint("loss", 2, 0.4)]),
        lambda s: checkpoints.record_checkpoint(
            s, job_id, 1, step=2, epoch=0, path="/x", size_bytes=1, sha256="0" * 64
        ),
    ):
        with pytest.raises(StaleAttemptError), db.session() as s:
            write(s)
    with db.session(write=False) as s:
        points, _ = metrics.query_points(s, job_id, "loss")
        assert [p.step for p in points] == [1]
        assert checkpoints.list_checkpoints(s, job_id) == []


def test_ingest_ignores_duplicates_and_keeps_latest(db: Database) -> None:
    job_id = _running_job(db)
    batch = [MetricPoint("loss", i, 1 / i, 0) for i in range(1, 101)]
    with db.session() as s:
        assert metrics.record_metrics(s, job_id, 1, batch, progress={"step": 100}) == 100
    with db.session() as s:
        replay = [*batch[50:], MetricPoint("loss", 101, math.inf), MetricPoint("acc", 3, math.nan)]
        assert metrics.record_metrics(s, job_id, 1, replay) == 2
    with db.session(write=False) as s:
        job = s.get(Job, job_id)
        assert job is not None
        assert job.latest_metrics == {
            "loss": {"step": 101, "value": "Infinity"},
            "acc": {"step": 3, "value": None},
        }
        assert job.progress == {"step": 100}
        points, cursor = metrics.query_points(s, job_id, "loss", after_step=0, limit=1000)
        assert [p.step for p in points] == list(range(1, 102)) and cursor == 101


def test_heartbeat_renews_leases_and_lists_held_jobs(db: Database) -> None:
    job_id = _running_job(db)
    with db.session() as s:
        s.get(Job, job_id).lease_expires_at = utcnow() - timedelta(seconds=1)  # type: ignore[union-attr]
    with db.session() as s:
        held = leases.heartbeat(s, "w", lease_s=60)
    assert [(h.job_id, h.attempt, h.state) for h in held] == [(job_id, 1, "running")]
    with db.session(write=False) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.lease_expires_at is not None
        assert job.lease_expires_at > utcnow() + timedelta(seconds=50)
        listed = workers.list_workers(s)
        assert [(w.id, held_ids) for w, held_ids in listed] == [("w", [job_id])]


def test_requeue_of_a_cancel_requested_job_cancels_it(db: Database) -> None:
    """A cancel accepted while a job runs survives a requeue (worker stopped, retry,
    preemption): the job ends cancelled, it is never queued again with the flag dropped."""
    job_id = _running_job(db)
    with db.session() as s:
        assert jobs.cancel_job(s, job_id).cancel_requested
    with db.session() as s:
        job = jobs.apply_transition(
            s,
            jobs.Transition(job_id, JobState.RUNNING, JobState.QUEUED, "worker stopped"),
            values={"restarts": 1},
        )
        assert (job.state, job.attempt, job.restarts) == ("cancelled", 1, 0), (
            "a requeue of a job whose cancel was requested must end it cancelled instead"
        )
        assert job.finished_at is not None and job.lease_expires_at is None
    with db.session(write=False) as s:
        last = jobs.list_events(s, job_id)[-1]
        assert (last.from_state, last.to_state, last.reason, last.attempt) == (
            "running",
            "cancelled",
            "cancel requested (instead of: worker stopped)",
            1,
        )
    with db.session() as s:
        assert (
            claims.claim_next_job(
                s, worker_id="w", launcher="local", max_gpus_per_node=0, lease_s=30
            )
            is None
        )


def test_requeue_without_cancel_still_requeues(db: Database) -> None:
    job_id = _running_job(db)
    with db.session() as s:
        job = jobs.apply_transition(
            s, jobs.Transition(job_id, JobState.RUNNING, JobState.QUEUED, "preempted")
        )
        assert (job.state, job.attempt, job.cancel_requested) == ("queued", 2, False)
    with pytest.raises(StaleStateError, match="no longer running"), db.session() as s:
        jobs.apply_transition(s, jobs.Transition(job_id, JobState.RUNNING, JobState.QUEUED))


def test_claim_never_drops_a_cancel_request(db: Database) -> None:
    """A queued job carrying the flag (written before the requeue rule existed) is
    never claimed with its flag reset; the reaper cancels it."""
    with db.session() as s:
        flagged, _ = jobs.submit_job(s, SPEC, owner="o")
        plain, _ = jobs.submit_job(s, SPEC, owner="o")
        workers.register_worker(s, worker_id="w", host="h", pid=1, launcher="local", capacity={})
    with db.session() as s:
        s.execute(update(Job).where(Job.id == flagged.id).values(cancel_requested=True))
    with db.session() as s:
        claimed = claims.claim_next_job(
            s, worker_id="w", launcher="local", max_gpus_per_node=0, lease_s=30
        )
        assert claimed is not None and claimed.id == plain.id, "the flagged job was claimed"
    with db.session() as s:
        reaped = leases.requeue_expired_jobs(s)
        assert [(t.job_id, t.target) for t in reaped] == [(flagged.id, JobState.CANCELLED)]
    with db.session(write=False) as s:
        job = jobs.get_job(s, flagged.id)
        assert (job.state, job.cancel_requested) == ("cancelled", True)
        assert jobs.list_events(s, flagged.id)[-1].reason == "cancel requested"


def test_cancel_never_flags_a_queued_job(db: Database) -> None:
    """Cancel flags only an active job: one requeued between cancel's read and its write
    is cancelled at once instead (a queued job never carries the flag)."""
    job_id = _running_job(db)
    with db.session() as s:
        seen = jobs.get_job(s, job_id)  # held: what cancel_job reads first is "running"
        assert seen.state == "running"
        s.execute(  # a reaper's requeue, behind this session's back
            update(Job)
            .where(Job.id == job_id)
            .values(state="queued", attempt=2, worker_id=None)
            .execution_options(synchronize_session=False)
        )
        job = jobs.cancel_job(s, job_id)
        assert (job.state, job.cancel_requested) == ("cancelled", False)
    with db.session(write=False) as s:
        assert jobs.list_events(s, job_id)[-1].reason == "cancelled while queued"


def test_job_ids_are_never_reused(db: Database) -> None:
    """Deleting the newest job must not hand its id out again (SQLite AUTOINCREMENT): a
    new job would meet the old one's artifacts under jobs/<id>/."""
    with db.session() as s:
        first, _ = jobs.submit_job(s, SPEC, owner="o")
        newest, _ = jobs.submit_job(s, SPEC, owner="o")
    with db.session() as s:
        s.execute(delete(Job).where(Job.id == newest.id))
    with db.session() as s:
        again, _ = jobs.submit_job(s, SPEC, owner="o")
    assert again.id > newest.id > first.id, f"job id {again.id} was reused"
