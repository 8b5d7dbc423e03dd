"""ASHA early stopping in the store on SQLite and PostgreSQL: 9 regression trials with
different learning rates report real metric rows at their own pace; the reaper's pass stops
the worse ones at the rungs, each with an event carrying the numbers, the stopped ones end
``stopped_early`` (not failed) with their curves kept, and the best trial runs to the end."""

from __future__ import annotations

import math
from datetime import timedelta

from sqlalchemy import func, insert, select

from service.core.config import Settings
from service.core.states import JobState
from service.core.sweeps.spec import SweepSpec, plan_trials, resolve_objective
from service.store.db import Database
from service.store.jobs import crud as jobs
from service.store.metrics import rollups
from service.store.models import Job, JobEvent, Metric, SweepTrial, utcnow
from service.store.reaper import reap_once
from service.store.sweeps.crud import get_sweep, submit_sweep
from service.store.sweeps.view import list_trials

LRS = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0]
BEST_LR = 2e-2  # the toy's loss is lowest near this lr: position 5 (3e-2) is the best trial
RUNGS = [10, 30, 90]  # rung_steps 10 × 3^k
MAX_STEPS = 100
# The order in which trials reach each rung (asynchronous: one pass per arrival).
ARRIVALS = [5, 0, 8, 2, 6, 1, 4, 7, 3]
# Worked out by hand from the rule (core.asha): at rung 0, 0 is 2nd of 2 (keep 1), 8 is 3rd
# of 3 (keep 1), 1 is 6th of 6 (keep 2), 7 and 3 are below the 3rd of 8 and 9; at rung 1,
# 2 and 6 fall outside the top 1 of 2 and 3; at rung 2, 4 is 2nd of 2.
EXPECTED_STOPS = {0: 0, 8: 0, 1: 0, 7: 0, 3: 0, 2: 1, 6: 1, 4: 2}


def loss(lr: float, step: int) -> float:
    return abs(math.log10(lr) - math.log10(BEST_LR)) + 1 / step


def test_asha_stops_the_worse_trials_at_the_rungs(db: Database, settings: Settings) -> None:
    spec = SweepSpec.model_validate(
        {
            "name": "asha",
            "base": {"name": "b", "task": "regression", "training": {"max_steps": MAX_STEPS}},
            "axes": {"training.lr": {"grid": LRS}},
            "early_stop": {"asha": {"rung_steps": RUNGS[0], "reduction_factor": 3}},
        }
    )
    with db.session() as s:
        sweep_id = submit_sweep(
            s, spec, resolve_objective(spec), plan_trials(spec, settings), owner="o"
        ).id
        job_ids = list(
            s.scalars(
                select(SweepTrial.job_id)
                .where(SweepTrial.sweep_id == sweep_id)
                .order_by(SweepTrial.position)
            )
        )
        for job_id in job_ids:  # every trial running, as on a big enough cluster
            jobs.apply_transition(s, jobs.Transition(job_id, JobState.QUEUED, JobState.STARTING))
            jobs.apply_transition(s, jobs.Transition(job_id, JobState.STARTING, JobState.RUNNING))
    reported = dict.fromkeys(range(9), 0)
    clock = utcnow()

    def report(pos: int, upto: int) -> None:
        nonlocal clock
        rows = []
        for step in range(reported[pos] + 1, upto + 1):
            clock += timedelta(milliseconds=1)
            rows.append(
                {
                    "job_id": job_ids[pos],
                    "name": "loss",
                    "step": step,
                    "attempt": 1,
                    "epoch": 0,
                    "value": loss(LRS[pos], step),
                    "time": clock,
                }
            )
        with db.session() as s:
            s.execute(insert(Metric), rows)
            rollups.rebuild(s, job_ids[pos], "loss")  # written around the ingest: its rollups too
        reported[pos] = upto

    def honour_cancels() -> None:  # what the worker does with a flagged job
        with db.session() as s:
            for job in s.scalars(
                select(Job).where(
                    Job.sweep_id == sweep_id, Job.cancel_requested.is_(True), Job.state == "running"
                )
            ).all():
                jobs.apply_transition(
                    s,
                    jobs.Transition(
                        job.id, JobState.RUNNING, JobState.CANCELLED, "cancel requested"
                    ),
                )

    for rung_step in [*RUNGS, MAX_STEPS]:
        for pos in ARRIVALS:
            with db.session(write=False) as s:
                if s.get(Job, job_ids[pos]).state != "running":  # type: ignore[union-attr]
                    continue
            report(pos, rung_step)
            reap_once(db)
            honour_cancels()
    with db.session() as s:
        best = s.get(Job, job_ids[5])
        assert best is not None and best.state == "running" and not best.cancel_requested
        jobs.apply_transition(s, jobs.Transition(best.id, JobState.RUNNING, JobState.SUCCEEDED))
    reap_once(db)

    with db.session(write=False) as s:
        sweep = get_sweep(s, sweep_id)
        trials = list_trials(s, sweep)
        stop_events = {
            job_id: reason
            for job_id, reason in s.execute(
                select(JobEvent.job_id, JobEvent.reason).where(
                    JobEvent.job_id.in_(job_ids), JobEvent.reason.like("stopped at rung%")
                )
            ).all()
        }
        stop_kinds = {
            (job_id, kind, data["rung"])
            for job_id, kind, data in s.execute(
                select(JobEvent.job_id, JobEvent.kind, JobEvent.data).where(
                    JobEvent.job_id.in_(job_ids), JobEvent.kind == "early_stopped"
                )
            ).all()
        }
        curves = dict(
            s.execute(
                select(Metric.job_id, func.count())
                .where(Metric.job_id.in_(job_ids))
                .group_by(Metric.job_id)
            ).all()
        )
    stopped = {t.position for t in trials if t.outcome == "stopped_early"}
    assert stopped == set(EXPECTED_STOPS), f"stopped {sorted(stopped)}"
    assert trials[5].outcome == "succeeded" and reported[5] == MAX_STEPS, "best ran to the end"
    assert sweep.state == "succeeded"
    for pos, rung in EXPECTED_STOPS.items():
        msg = stop_events[job_ids[pos]]
        step = RUNGS[rung]
        assert msg.startswith(f"stopped at rung {rung}, step {step}: loss "), msg
        assert f"{loss(LRS[pos], step):.4g} not in the top 1/3 (cut " in msg, msg
        assert trials[pos].state == "cancelled", "a stopped trial's job is cancelled, not failed"
        assert (job_ids[pos], "early_stopped", rung) in stop_kinds, stop_kinds
        assert curves[job_ids[pos]] == step, "a stopped trial keeps its curve"
    assert len(stop_kinds) == len(EXPECTED_STOPS), "one early_stopped event per stopped trial"
    assert "of 9 trials" in stop_events[job_ids[3]], "the last arrival at rung 0 saw all 9"
    assert len(stop_events) == len(EXPECTED_STOPS), "one stop event per stopped trial"
