"""max_concurrent held by the claim under concurrent claimers, on SQLite and PostgreSQL:
never more than max_concurrent trials of a sweep starting or running, every job claimed
once, plain jobs and other sweeps unaffected, priorities across sweeps as for jobs."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from sqlalchemy import func, select

from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.core.sweeps.spec import SweepSpec, plan_trials, resolve_objective
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs import crud as jobs
from service.store.models import Job
from service.store.sweeps.crud import submit_sweep
from service.store.workers.registry import register_worker

N_CLAIMERS = 8
MAX_CONCURRENT = 3


def _sweep(db: Database, settings: Settings, n: int, **changes: Any) -> int:
    spec = SweepSpec.model_validate(
        {
            "name": "race",
            "base": {"name": "b", "task": "regression", **changes.pop("base", {})},
            "axes": {"config.hidden": {"grid": list(range(1, n + 1))}},
            **changes,
        }
    )
    with db.session() as s:
        sweep = submit_sweep(
            s, spec, resolve_objective(spec), plan_trials(spec, settings), owner="t"
        )
        return sweep.id


def _holding(db: Database, sweep_id: int) -> int:
    with db.session(write=False) as s:
        return (
            s.scalar(
                select(func.count()).where(
                    Job.sweep_id == sweep_id, Job.state.in_(claims.HOLDING_STATES)
                )
            )
            or 0
        )


def test_concurrent_claimers_never_exceed_max_concurrent(db: Database, settings: Settings) -> None:
    sweep_id = _sweep(db, settings, 30, max_concurrent=MAX_CONCURRENT)
    other = _sweep(db, settings, 6, max_concurrent=1)
    with db.session() as s:
        for i in range(10):
            jobs.submit_job(s, JobSpec(name=f"plain-{i}", task="regression"), owner="t")
        for c in range(N_CLAIMERS):
            register_worker(s, worker_id=f"w{c}", host="h", pid=c, launcher="local", capacity={})
    claimed: list[int] = []
    seen: list[tuple[int, int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def claimer(worker_id: str) -> None:
        idle = 0
        try:
            while idle < 20:
                with db.session() as s:
                    job = claims.claim_next_job(
                        s, worker_id=worker_id, launcher="local", max_gpus_per_node=0, lease_s=60
                    )
                    got = (job.id, job.sweep_id) if job is not None else None
                if got is None:
                    idle += 1
                    continue
                idle = 0
                with lock:
                    claimed.append(got[0])
                    if got[1] is not None:  # committed claims only: the invariant to hold
                        seen.append((got[1], _holding(db, got[1])))
                with db.session() as s:  # finish it, freeing the place
                    jobs.apply_transition(
                        s, jobs.Transition(got[0], JobState.STARTING, JobState.SUCCEEDED)
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
    assert len(claimed) == 30 + 6 + 10, "every job was claimed in the end"
    worst = {sid: max(n for s, n in seen if s == sid) for sid in (sweep_id, other)}
    assert worst[sweep_id] <= MAX_CONCURRENT, f"sweep held {worst[sweep_id]} places at once"
    assert worst[other] <= 1, f"the max_concurrent 1 sweep held {worst[other]} at once"


def test_held_claims_stop_at_max_concurrent_and_priorities_cross_sweeps(
    db: Database, settings: Settings
) -> None:
    low = _sweep(db, settings, 5, max_concurrent=2)
    high = _sweep(db, settings, 5, max_concurrent=2, base={"priority": 10})
    with db.session() as s:
        register_worker(s, worker_id="w", host="h", pid=1, launcher="local", capacity={})
    order = []
    with db.session() as s:
        while (
            j := claims.claim_next_job(
                s, worker_id="w", launcher="local", max_gpus_per_node=0, lease_s=60
            )
        ) is not None:
            order.append(j.sweep_id)
    assert order == [high, high, low, low], "priority first; each sweep stops at its limit"
