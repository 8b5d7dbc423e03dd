"""The trials table sorted in SQL, the best trial and the counts by outcome computed in SQL
(``service.store.sweeps.view``/``columns``), on SQLite and PostgreSQL, against the Python
rules they replace (``table.sort_trials``, and the best/counts over every trial below) on
mixed data: missing values, ties, values that are not numbers (text, bools, NaN, ±inf,
legacy bare numbers), steps that are not integers, recorded outcomes, cancel flags, trials
without a job."""

from __future__ import annotations

import math
import random
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import insert, select, update

from service.core.config import Settings
from service.core.states import JobState
from service.core.sweeps.spec import SweepSpec, plan_trials, resolve_objective
from service.store.db import Database
from service.store.metrics import rollups
from service.store.models import Job, Metric, Sweep, SweepTrial, utcnow
from service.store.sweeps import columns, table, view
from service.store.sweeps.crud import submit_sweep
from service.store.sweeps.values import TrialView

TRIALS = 36
VALUES: list[Any] = [0.5, 0.2, 0.2, -1.0, 3, 0, 1e-300, 1.7976931348623157e308, 0.30000000000000004]
# latest_metrics entries that are not a number the view shows: None as the objective.
NOT_NUMBERS: list[Any] = [None, "Infinity", "-Infinity", True, False, "0.1", [1], {"v": 1}]
STEPS: list[Any] = [None, 0, 7, 7, 12, -3, 5.0, True, "9", 2**40]
METRIC_VALUES: list[float | None] = [0.4, 0.1, 0.1, None, math.inf, -math.inf, 2.5, -0.0]


def latest_metrics(rng: random.Random, metric: str) -> Any:
    """One job's ``latest_metrics``: the entry as stored now, a legacy bare number, a
    non-number, another metric only, or none."""
    pick = rng.randrange(7)
    if pick <= 2:
        return {metric: {"step": 3, "value": rng.choice(VALUES)}, "other": {"step": 1, "value": 9}}
    if pick == 3:
        return {metric: rng.choice(VALUES)}
    if pick == 4:
        return {metric: {"step": 3, "value": rng.choice(NOT_NUMBERS)}}
    if pick == 5:
        return {"other": {"step": 1, "value": 0.0}}
    return rng.choice([None, {}])


def seed(db: Database, settings: Settings, objective: dict[str, str], rng: random.Random) -> int:
    """A sweep of ``TRIALS`` trials with mixed rows; returns its id."""
    spec = SweepSpec.model_validate(
        {
            "name": "mixed",
            "base": {"name": "b", "task": "regression", "training": {"max_steps": 5}},
            "axes": {"training.lr": {"grid": [round(0.001 * (i + 1), 6) for i in range(TRIALS)]}},
            "objective": objective,
        }
    )
    metric = objective["metric"]
    states = [s.value for s in JobState]
    now = utcnow()
    with db.session() as s:
        sweep_id = submit_sweep(
            s, spec, resolve_objective(spec), plan_trials(spec, settings), owner="o"
        ).id
        rows = s.execute(
            select(SweepTrial.id, SweepTrial.job_id)
            .where(SweepTrial.sweep_id == sweep_id)
            .order_by(SweepTrial.position)
        ).all()
        for trial_id, job_id in rows:
            started = now - timedelta(seconds=rng.choice([10, 20, 20, 30]))
            s.execute(
                update(Job)
                .where(Job.id == job_id)
                .values(
                    state=rng.choice(states),
                    cancel_requested=rng.random() < 0.3,
                    latest_metrics=latest_metrics(rng, metric),
                    progress=rng.choice([None, {}, *({"step": v} for v in STEPS)]),
                    started_at=started if rng.random() < 0.8 else None,
                )
            )
            for step, value in enumerate(rng.sample(METRIC_VALUES, rng.randrange(4)), 1):
                s.execute(
                    insert(Metric).values(
                        job_id=job_id, name=metric, step=step, attempt=1, value=value, time=now
                    )
                )
            rollups.rebuild_job(s, job_id)  # written around the ingest: its rollups too
            s.execute(
                update(SweepTrial)
                .where(SweepTrial.id == trial_id)
                .values(
                    attempts=rng.choice([1, 1, 2, 3]),
                    outcome="stopped_early" if rng.random() < 0.15 else None,
                    job_id=None if rng.random() < 0.08 else job_id,
                )
            )
    return sweep_id


def shown(t: TrialView) -> tuple[Any, ...]:
    """What a row shows, but its run time (read at another instant)."""
    return (t.key, t.job_id, t.outcome, t.attempts, t.steps_done, t.objective_value)


def python_best(trials: list[TrialView], mode: str) -> TrialView | None:
    """The rule as it was computed over every trial in Python."""
    scored = [t for t in trials if t.objective_value is not None and t.may_be_best]
    if not scored:
        return None
    pick = max if mode == "max" else min
    return pick(scored, key=lambda t: t.objective_value or 0.0)


OBJECTIVES = [
    {"metric": "loss", "mode": "min", "at": "last"},
    {"metric": 'acc "top-1" é.x', "mode": "max", "at": "last"},
    {"metric": "loss", "mode": "min", "at": "best"},
    {"metric": "loss", "mode": "max", "at": "best"},
]


@pytest.mark.parametrize("objective", OBJECTIVES, ids=lambda o: f"{o['mode']}-{o['at']}")
@pytest.mark.parametrize("seed_value", [1, 2])
def test_sql_order_best_and_counts_equal_the_python_rules(
    db: Database, settings: Settings, objective: dict[str, str], seed_value: int
) -> None:
    sweep_id = seed(db, settings, objective, random.Random(seed_value))
    with db.session(write=False) as s:
        sweep = s.get(Sweep, sweep_id)
        assert sweep is not None
        every = view.list_trials(s, sweep)
        assert [t.position for t in every] == list(range(TRIALS))
        for sort in sorted(columns.SQL_SORTS):
            for descending in (False, True):
                want = table.sort_trials(every, sort, descending=descending)
                got = view.list_trials(s, sweep, sort=sort, descending=descending)
                assert [t.position for t in got] == [t.position for t in want], (
                    f"sort={sort} descending={descending}: SQL order differs from "
                    "table.sort_trials; fix columns.sort_key for this column"
                )
                assert [shown(t) for t in got] == [shown(t) for t in want], sort
                page = view.list_trials(
                    s, sweep, sort=sort, descending=descending, offset=5, limit=7
                )
                assert [t.key for t in page] == [t.key for t in want[5:12]]
        best = view.best_trial(s, sweep)
        want_best = python_best(every, objective["mode"])
        assert (best and best.key) == (want_best and want_best.key), f"best {best} != {want_best}"
        counts = Counter(t.outcome for t in every)
        assert view.outcome_counts(s, sweep) == {o: counts.get(o, 0) for o in view.OUTCOMES}


def test_an_unknown_sql_sort_is_refused(db: Database, settings: Settings) -> None:
    sweep_id = seed(db, settings, OBJECTIVES[0], random.Random(0))
    with db.session(write=False) as s:
        sweep = s.get(Sweep, sweep_id)
        assert sweep is not None
        with pytest.raises(ValueError, match="run_time_s"):
            view.list_trials(s, sweep, sort="run_time_s")
