"""The batch claim (``service.store.jobs.batch_claims``) on SQLite and PostgreSQL: one sweep's
trials at a time, best first, never more than the sweep's max_concurrent starting or running,
a plain job alone, and no trial claimed twice by racing claimers."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from sqlalchemy import func, select

from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.core.sweeps.spec import SweepSpec, plan_trials, resolve_objective
from service.store.db import Database
from service.store.jobs import crud as jobs
from service.store.jobs.batch_claims import ClaimedBatch, claim_trial_batch
from service.store.jobs.crud import Transition
from service.store.models import Job, JobEvent
from service.store.sweeps import crud as sweeps
from service.store.workers.registry import register_worker

BASE = {"task": "regression", "launcher": "local", "training": {"max_steps": 5}}


def _sweep(db: Database, settings: Settings, n: int, max_concurrent: int | None) -> list[int]:
    """A sweep of ``n`` trials; their job ids, in order."""
    spec = SweepSpec.model_validate({
        "name": "b", "base": BASE, "axes": {"training.lr": {"grid": [0.001 * (i + 1)
                                                                     for i in range(n)]}},
        "max_concurrent": max_concurrent,
    })  # fmt: skip
    with db.session() as s:
        sweep = sweeps.submit_sweep(
            s, spec, resolve_objective(spec), plan_trials(spec, settings), owner="t"
        )
        sweep_id = sweep.id
    with db.session(write=False) as s:
        return list(s.scalars(select(Job.id).where(Job.sweep_id == sweep_id).order_by(Job.id)))


def _plain_job(db: Database) -> int:
    with db.session() as s:
        job, _ = jobs.submit_job(s, JobSpec.model_validate({"name": "p", **BASE}), owner="t")
        return job.id


def _workers(db: Database, n: int) -> None:
    with db.session() as s:
        for i in range(n):
            register_worker(s, worker_id=f"w{i}", host="h", pid=i, launcher="local",
                            capacity={"slots": 8})  # fmt: skip


def _claim(db: Database, limit: int, worker_id: str = "w0") -> ClaimedBatch | None:
    with db.session() as s:
        batch = claim_trial_batch(s, worker_id=worker_id, launcher="local", max_gpus_per_node=0,
                                  lease_s=60, limit=limit)  # fmt: skip
        if batch is not None:
            for job in batch.jobs:
                s.expunge(job)
        return batch


def _finish(db: Database, job_id: int) -> None:
    with db.session() as s:
        for expected, target in ((JobState.STARTING, JobState.RUNNING),
                                 (JobState.RUNNING, JobState.SUCCEEDED)):  # fmt: skip
            jobs.apply_transition(s, Transition(job_id, expected, target, "test"), worker_id="w0")


def test_a_batch_is_one_sweeps_trials_within_its_max_concurrent(
    db: Database, settings: Settings
) -> None:
    _workers(db, 1)
    trials = _sweep(db, settings, 5, max_concurrent=2)
    plain = _plain_job(db)

    first = _claim(db, limit=10)
    assert first is not None and first.sweep_id is not None and first.max_concurrent == 2
    assert [j.id for j in first.jobs] == trials[:2], "best first: the two oldest trials"
    assert all(j.state == "starting" and j.worker_id == "w0" for j in first.jobs)
    with db.session(write=False) as s:
        claimed_events = s.scalar(
            select(func.count()).where(JobEvent.reason == "claimed", JobEvent.job_id.in_(trials))
        )
    assert claimed_events == 2, "every claimed trial gets its claimed event"

    # The sweep is full: the next claim takes the plain job, alone.
    second = _claim(db, limit=10)
    assert second is not None and second.sweep_id is None and [j.id for j in second.jobs] == [plain]
    assert _claim(db, limit=10) is None

    # One trial ends: exactly one place is free again.
    _finish(db, trials[0])
    third = _claim(db, limit=10)
    assert third is not None and [j.id for j in third.jobs] == [trials[2]]
    assert _claim(db, limit=10) is None


def test_the_limit_caps_a_batch_of_a_sweep_without_max_concurrent(
    db: Database, settings: Settings
) -> None:
    _workers(db, 1)
    trials = _sweep(db, settings, 5, max_concurrent=None)
    batch = _claim(db, limit=3)
    assert batch is not None and batch.max_concurrent is None
    assert [j.id for j in batch.jobs] == trials[:3]
    rest = _claim(db, limit=3)
    assert rest is not None and [j.id for j in rest.jobs] == trials[3:]
    with pytest.raises(ValueError, match="limit"):
        _claim(db, limit=0)


def test_racing_batch_claimers_never_exceed_max_concurrent_nor_claim_twice(
    db: Database, settings: Settings
) -> None:
    n_claimers, max_concurrent = 6, 3
    _workers(db, n_claimers)
    trials = _sweep(db, settings, 30, max_concurrent=max_concurrent)
    claimed: dict[str, list[int]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(n_claimers)

    def claimer(worker_id: str) -> None:
        mine: list[int] = []
        try:
            start.wait(timeout=30)
            for _ in range(5):
                batch = _claim(db, limit=2, worker_id=worker_id)
                mine += [j.id for j in batch.jobs] if batch else []
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        claimed[worker_id] = mine

    threads = [threading.Thread(target=claimer, args=(f"w{i}",)) for i in range(n_claimers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, f"claimers raised: {errors[:3]}"
    all_ids = [i for ids in claimed.values() for i in ids]
    assert not [i for i, n in Counter(all_ids).items() if n > 1], f"claimed twice: {claimed}"
    assert len(all_ids) == max_concurrent, f"max_concurrent {max_concurrent}, got {claimed}"
    with db.session(write=False) as s:
        starting = s.scalar(select(func.count()).where(Job.id.in_(trials), Job.state == "starting"))
    assert starting == max_concurrent
