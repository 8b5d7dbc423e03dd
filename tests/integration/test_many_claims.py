"""A worker with several free slots claims several jobs in one statement
(``batch_claims.claim_next_jobs``), on SQLite and PostgreSQL: the best ones first, each once
under racing claimers, sweeps held to their ``max_concurrent`` (the excess undone in the same
transaction), plain jobs and trials of any sweep in one claim."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from sqlalchemy import func, select

from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.core.sweeps.spec import SweepSpec, plan_trials, resolve_objective
from service.store.attempts import service as attempts
from service.store.db import Database
from service.store.jobs import batch_claims, claims
from service.store.jobs import crud as jobs
from service.store.models import Job, JobEvent
from service.store.sweeps.crud import submit_sweep
from service.store.workers import service as workers
from service.store.workers.registry import register_worker

N_CLAIMERS = 6


def _plain(db: Database, n: int, priority: int = 0) -> list[int]:
    with db.session() as s:
        return [
            jobs.submit_job(
                s, JobSpec(name=f"p{i}", task="regression", priority=priority), owner="t"
            )[0].id
            for i in range(n)
        ]


def _sweep(db: Database, settings: Settings, n: int, **changes: Any) -> int:
    spec = SweepSpec.model_validate(
        {
            "name": "many",
            "base": {"name": "b", "task": "regression", **changes.pop("base", {})},
            "axes": {"config.hidden": {"grid": list(range(1, n + 1))}},
            **changes,
        }
    )
    with db.session() as s:
        return submit_sweep(
            s, spec, resolve_objective(spec), plan_trials(spec, settings), owner="t"
        ).id


def _workers(db: Database, n: int) -> None:
    with db.session() as s:
        for c in range(n):
            register_worker(s, worker_id=f"w{c}", host="h", pid=c, launcher="local", capacity={})


def _claim(db: Database, limit: int, worker_id: str = "w0") -> list[Job]:
    with db.session() as s:
        got = batch_claims.claim_next_jobs(
            s, worker_id=worker_id, launcher="local", max_gpus_per_node=0, lease_s=60, limit=limit
        )
        s.expunge_all()
        return got


def test_one_claim_takes_the_best_jobs_up_to_its_limit(db: Database) -> None:
    low = _plain(db, 3)
    high = _plain(db, 2, priority=5)
    _workers(db, 1)
    got = _claim(db, 4)
    assert [j.id for j in got] == [*high, *low[:2]], "priority first, then oldest, limit 4"
    assert {j.state for j in got} == {JobState.STARTING.value}
    assert {j.worker_id for j in got} == {"w0"}
    with db.session(write=False) as s:
        events = s.scalars(select(JobEvent.job_id).where(JobEvent.to_state == "starting")).all()
    assert sorted(events) == sorted(j.id for j in got), "one claimed event per job"
    assert [j.id for j in _claim(db, 4)] == [low[2]], "what is left, never more"
    assert _claim(db, 4) == []


def test_a_sweep_among_many_claims_keeps_its_max_concurrent(
    db: Database, settings: Settings
) -> None:
    """One statement sees a sweep's free places once: 5 trials of a max_concurrent 2 sweep
    are candidates together, only 2 may stay claimed; the claim goes on to plain jobs."""
    sweep_id = _sweep(db, settings, 5, max_concurrent=2, base={"priority": 10})
    plain = _plain(db, 3)
    _workers(db, 1)
    got = _claim(db, 6)
    trials = [j.id for j in got if j.sweep_id == sweep_id]
    assert len(trials) == 2, f"the sweep holds {len(trials)} places, its limit is 2"
    with db.session(write=False) as s:
        holding = s.scalar(
            select(func.count()).where(
                Job.sweep_id == sweep_id, Job.state.in_(claims.HOLDING_STATES)
            )
        )
        undone_events = s.scalar(
            select(func.count()).where(
                JobEvent.job_id.in_(select(Job.id).where(Job.sweep_id == sweep_id)),
                JobEvent.to_state == "starting",
            )
        )
        requeued = s.scalars(
            select(Job.worker_id).where(Job.sweep_id == sweep_id, Job.state == "queued")
        ).all()
    assert holding == 2 and undone_events == 2, "the excess claims leave no trace"
    assert requeued == [None, None, None]
    # The plain jobs: whatever the limit left room for, best (oldest) first.
    assert [j.id for j in got if j.sweep_id is None] == plain[: len(got) - 2]


def test_racing_claimers_of_many_jobs_claim_each_once(db: Database, settings: Settings) -> None:
    plain = _plain(db, 60)
    sweep_id = _sweep(db, settings, 12, max_concurrent=3)
    _workers(db, N_CLAIMERS)
    claimed: list[int] = []
    errors: list[BaseException] = []
    worst_holding = [0]
    lock = threading.Lock()

    def claimer(worker_id: str) -> None:
        idle = 0
        try:
            while idle < 10:
                got = _claim(db, 4, worker_id)
                if not got:
                    idle += 1
                    continue
                idle = 0
                with db.session(write=False) as s:  # committed claims: the invariant to hold
                    held = s.scalar(
                        select(func.count()).where(
                            Job.sweep_id == sweep_id, Job.state.in_(claims.HOLDING_STATES)
                        )
                    )
                with lock:
                    claimed.extend(j.id for j in got)
                    worst_holding[0] = max(worst_holding[0], int(held or 0))
                with db.session() as s:  # finish them, freeing the sweep's places
                    for j in got:
                        jobs.apply_transition(
                            s, jobs.Transition(j.id, JobState.STARTING, JobState.SUCCEEDED)
                        )
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=claimer, args=(f"w{c}",)) for c in range(N_CLAIMERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, f"claimers raised: {errors[:3]}"
    dupes = [i for i, n in Counter(claimed).items() if n > 1]
    assert not dupes, f"jobs claimed more than once: {dupes[:10]}"
    assert len(claimed) == len(plain) + 12, "every job was claimed in the end"
    assert worst_holding[0] <= 3, f"the sweep held {worst_holding[0]} places at once"


def test_the_use_case_mints_one_attempt_token_per_job(db: Database) -> None:
    _plain(db, 3)
    _workers(db, 1)
    got = workers.claim_for_worker(
        db, worker_id="w0", launcher="local", max_gpus_per_node=0, lease_s=60, limit=3
    )
    assert got is not None and len(got.jobs) == 3 and got.sweep_id is None
    tokens = [j.attempt_token for j in got.jobs]
    assert all(tokens) and len(set(tokens)) == 3
    refs = [attempts.find_attempt(db, t) for t in tokens]
    assert [(r.job_id, r.attempt) for r in refs if r] == [(j.job_id, 1) for j in got.jobs]
