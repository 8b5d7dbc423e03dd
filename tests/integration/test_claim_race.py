"""The claim race: many concurrent claimers, every job claimed exactly once (both databases)."""

from __future__ import annotations

import threading
from collections import Counter

from sqlalchemy import func, insert, select

from service.core.spec.model import JobSpec
from service.store.db import Database
from service.store.jobs import claims
from service.store.models import Job, JobEvent
from service.store.workers.registry import register_worker

N_JOBS = 500
N_CLAIMERS = 8


def _queue_jobs(db: Database, n: int, **overrides: object) -> None:
    spec = JobSpec(name="race", task="regression").model_dump(mode="json")
    rows = [
        {
            "name": f"race-{i}",
            "owner": "t",
            "state": "queued",
            "spec": spec,
            "launcher": "local",
            "gpus_per_node": 0,
            "priority": 0,
            "attempt": 1,
            "restarts": 0,
            "cancel_requested": False,
            **overrides,
        }
        for i in range(n)
    ]
    with db.session() as s:
        s.execute(insert(Job), rows)


def test_every_job_claimed_exactly_once(db: Database) -> None:
    _queue_jobs(db, N_JOBS)
    claimed: dict[str, list[int]] = {}
    errors: list[BaseException] = []
    with db.session() as s:
        for c in range(N_CLAIMERS):
            register_worker(
                s, worker_id=f"w{c}", host="h", pid=c, launcher="local", capacity={"slots": 1}
            )

    def claimer(worker_id: str) -> None:
        mine: list[int] = []
        try:
            while True:
                with db.session() as s:
                    job = claims.claim_next_job(
                        s, worker_id=worker_id, launcher="local", max_gpus_per_node=0, lease_s=60
                    )
                    if job is None:
                        break
                    mine.append(job.id)
        except BaseException as exc:  # surfaced below with the worker's name
            errors.append(exc)
        claimed[worker_id] = mine

    threads = [threading.Thread(target=claimer, args=(f"w{c}",)) for c in range(N_CLAIMERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, f"claimers raised: {errors[:3]}"
    all_ids = [i for ids in claimed.values() for i in ids]
    dupes = [i for i, n in Counter(all_ids).items() if n > 1]
    assert not dupes, f"jobs claimed more than once: {dupes[:10]}"
    assert len(all_ids) == N_JOBS, f"expected {N_JOBS} claims, got {len(all_ids)}"
    with db.session(write=False) as s:
        assert s.scalar(select(func.count()).where(Job.state == "queued")) == 0
        owners = dict(s.execute(select(Job.id, Job.worker_id)).all())
        events = s.scalar(select(func.count()).where(JobEvent.reason == "claimed"))
    assert events == N_JOBS, "each claim writes exactly one event"
    for worker_id, ids in claimed.items():
        assert all(owners[i] == worker_id for i in ids)


def test_claim_order_and_fit(db: Database) -> None:
    """Highest priority first, then oldest; GPU jobs only go to workers with enough GPUs."""
    _queue_jobs(db, 2)
    _queue_jobs(db, 1, priority=5)
    _queue_jobs(db, 1, priority=9, gpus_per_node=2)
    _queue_jobs(db, 1, launcher="slurm", priority=100)
    with db.session() as s:
        register_worker(s, worker_id="w", host="h", pid=1, launcher="local", capacity={})
    order = []
    with db.session() as s:
        while (
            j := claims.claim_next_job(
                s, worker_id="w", launcher="local", max_gpus_per_node=0, lease_s=5
            )
        ) is not None:
            order.append((j.priority, j.gpus_per_node, j.id))
    assert [p for p, _, _ in order] == [5, 0, 0]
    assert order[1][2] < order[2][2], "equal priority → oldest first"
    with db.session() as s:
        gpu_job = claims.claim_next_job(
            s, worker_id="w", launcher="local", max_gpus_per_node=2, lease_s=5
        )
    assert gpu_job is not None and gpu_job.gpus_per_node == 2
