"""Leases: adopting Slurm jobs whose worker is gone (re-attach), the adoptable rule shared
with the reaper, and the attempt fence for a rank's spec, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import update

from service.core.config import Settings
from service.core.errors import NotFoundError, StaleAttemptError
from service.core.spec.model import validate_spec
from service.core.states import JobState
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs import crud as jobs
from service.store.models import Job, utcnow
from service.store.workers import leases
from service.store.workers.registry import register_worker, stop_worker


def _worker(db: Database, worker_id: str, launcher: str = "slurm") -> None:
    with db.session() as s:
        register_worker(
            s, worker_id=worker_id, host="h", pid=1, launcher=launcher, capacity={"slots": 4}
        )


def _started_job(
    db: Database,
    settings: Settings,
    *,
    worker_id: str,
    launcher: str = "slurm",
    scheduler_job_id: str | None = "101",
    expired: bool = True,
) -> int:
    """A job claimed by ``worker_id`` and running; its lease expired if ``expired``."""
    spec = validate_spec(
        {"name": "a", "task": "regression", "launcher": launcher},
        settings.model_copy(update={"slurm_enabled": True}),
    )
    with db.session() as s:
        job, _ = jobs.submit_job(s, spec, owner="t")
        claimed = claims.claim_next_job(
            s, worker_id=worker_id, launcher=launcher, max_gpus_per_node=0, lease_s=30
        )
        assert claimed is not None and claimed.id == job.id
        jobs.apply_transition(s, jobs.Transition(job.id, JobState.STARTING, JobState.RUNNING))
        if scheduler_job_id is not None:
            jobs.set_scheduler_job_id(s, job.id, 1, scheduler_job_id)
        if expired:
            s.execute(
                update(Job)
                .where(Job.id == job.id)
                .values(lease_expires_at=utcnow() - timedelta(seconds=5))
            )
        return job.id


def _holder(db: Database, job_id: int) -> str | None:
    with db.session(write=False) as s:
        job = s.get(Job, job_id)
        assert job is not None
        return job.worker_id


def test_adopts_a_slurm_job_whose_lease_expired(db: Database, settings: Settings) -> None:
    _worker(db, "old")
    _worker(db, "new")
    job_id = _started_job(db, settings, worker_id="old", scheduler_job_id="4242")
    with db.session() as s:
        adopted = leases.adopt_detached_jobs(s, launcher="slurm", worker_id="new", lease_s=30)
    assert [(a.job_id, a.scheduler_job_id, a.previous_worker_id) for a in adopted] == [
        (job_id, "4242", "old")
    ]
    assert adopted[0].state == JobState.RUNNING and adopted[0].attempt == 1
    assert _holder(db, job_id) == "new"
    # The new lease is live: the reaper leaves the job alone, and nobody adopts it again.
    with db.session() as s:
        assert leases.requeue_expired_jobs(s) == []
        assert leases.adopt_detached_jobs(s, launcher="slurm", worker_id="third", lease_s=30) == []


def test_leaves_jobs_whose_worker_is_alive(db: Database, settings: Settings) -> None:
    _worker(db, "alive")
    job_id = _started_job(db, settings, worker_id="alive", expired=False)
    with db.session() as s:
        assert leases.adopt_detached_jobs(s, launcher="slurm", worker_id="new", lease_s=30) == []
    assert _holder(db, job_id) == "alive"


def test_adopts_at_once_from_a_stopped_worker(db: Database, settings: Settings) -> None:
    _worker(db, "stopped")
    job_id = _started_job(db, settings, worker_id="stopped", expired=False)
    with db.session() as s:
        stop_worker(s, "stopped")
    _worker(db, "new")
    with db.session() as s:
        adopted = leases.adopt_detached_jobs(s, launcher="slurm", worker_id="new", lease_s=30)
    assert [a.job_id for a in adopted] == [job_id]


def test_ignores_jobs_not_yet_on_slurm_local_jobs_and_finished_jobs(
    db: Database, settings: Settings
) -> None:
    _worker(db, "old")
    _worker(db, "old-local", launcher="local")
    not_submitted = _started_job(db, settings, worker_id="old", scheduler_job_id=None)
    local = _started_job(db, settings, worker_id="old-local", launcher="local")
    finished = _started_job(db, settings, worker_id="old", scheduler_job_id="7")
    with db.session() as s:
        jobs.apply_transition(s, jobs.Transition(finished, JobState.RUNNING, JobState.SUCCEEDED))
    with db.session() as s:
        assert leases.adopt_detached_jobs(s, launcher="slurm", worker_id="new", lease_s=30) == []
    assert _holder(db, not_submitted) == "old" and _holder(db, local) == "old-local"


def test_two_adopters_never_both_get_a_job(db: Database, settings: Settings) -> None:
    for worker_id in ("old", "a", "b"):
        _worker(db, worker_id)
    ids = [_started_job(db, settings, worker_id="old", scheduler_job_id=str(i)) for i in (1, 2)]
    with db.session() as s:
        first = leases.adopt_detached_jobs(s, launcher="slurm", worker_id="a", lease_s=30, limit=1)
    with db.session() as s:
        second = leases.adopt_detached_jobs(s, launcher="slurm", worker_id="b", lease_s=30)
    assert [j.job_id for j in first] == ids[:1]
    assert [j.job_id for j in second] == ids[1:]


def test_spec_for_attempt_is_fenced(db: Database, settings: Settings) -> None:
    _worker(db, "w")
    job_id = _started_job(db, settings, worker_id="w", expired=False)
    with db.session(write=False) as s:
        spec = leases.spec_for_attempt(s, job_id, 1)
    assert spec["name"] == "a" and spec["launcher"] == "slurm"
    with db.session(write=False) as s, pytest.raises(StaleAttemptError, match="is stale"):
        leases.spec_for_attempt(s, job_id, 2)
    with db.session() as s:
        jobs.apply_transition(s, jobs.Transition(job_id, JobState.RUNNING, JobState.SUCCEEDED))
    with db.session(write=False) as s, pytest.raises(StaleAttemptError, match="succeeded"):
        leases.spec_for_attempt(s, job_id, 1)
    with db.session(write=False) as s, pytest.raises(NotFoundError):
        leases.spec_for_attempt(s, job_id + 100, 1)
