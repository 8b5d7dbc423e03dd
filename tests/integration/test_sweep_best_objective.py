"""A sweep whose objective is a metric's best value (``at: best``) ranks its trials by the
best of their current points, on both databases: points sent through the real ingest, far
apart in steps (several rollup buckets), with NaN, ±inf, and a resume that supersedes a
trial's best point."""

from __future__ import annotations

import math

import pytest
from sqlalchemy import select

from service.core.config import Settings
from service.core.metrics.points import MetricPoint, checked_point
from service.core.states import JobState
from service.core.sweeps.spec import SweepSpec, plan_trials, resolve_objective
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs import crud as jobs
from service.store.metrics.history import supersede_after_resume
from service.store.metrics.points import record_metrics
from service.store.models import Sweep, SweepTrial
from service.store.sweeps import view
from service.store.sweeps.crud import submit_sweep
from service.store.workers import registry as workers

# Per trial position: (step, value) points of "loss". Steps span several of the coarsest
# rollup buckets (2**15 steps) so a per-bucket answer alone would be wrong.
HISTORIES: list[dict[int, float]] = [
    {1: 3.0, 40_000: 0.5, 70_000: 2.0, 70_001: math.nan},
    {1: 1.0, 2: -math.inf, 99_999: 4.0},  # not finite: no objective, never best
    {1: 2.5, 50_000: 0.1, 50_001: 7.5},  # 0.1 and 7.5 superseded by the resume below
    {5: math.nan},  # only NaN: no objective
]
RESUMED = 2  # position whose second attempt resumes from RESUME_STEP
RESUME_STEP = 45_000


def _sweep(db: Database, settings: Settings, mode: str) -> int:
    spec = SweepSpec.model_validate(
        {
            "name": "best",
            "base": {"name": "b", "task": "regression", "training": {"max_steps": 5}},
            "axes": {"training.lr": {"grid": [0.1, 0.2, 0.3, 0.4]}},
            "objective": {"metric": "loss", "mode": mode, "at": "best"},
        }
    )
    with db.session() as s:
        workers.register_worker(s, worker_id="w", host="h", pid=1, launcher="local", capacity={})
        return submit_sweep(
            s, spec, resolve_objective(spec), plan_trials(spec, settings), owner="o"
        ).id


def _run_trials(db: Database, sweep_id: int) -> list[int]:
    """Claim each trial's job, make it running and send its history; the jobs by position."""
    with db.session() as s:
        job_ids = [
            j
            for j in s.scalars(
                select(SweepTrial.job_id)
                .where(SweepTrial.sweep_id == sweep_id)
                .order_by(SweepTrial.position)
            )
            if j is not None
        ]
    for _ in job_ids:
        with db.session() as s:
            job = claims.claim_next_job(
                s, worker_id="w", launcher="local", max_gpus_per_node=0, lease_s=30
            )
            assert job is not None
            jobs.apply_transition(s, jobs.Transition(job.id, JobState.STARTING, JobState.RUNNING))
            attempt = int(job.attempt)
        position = job_ids.index(job.id)
        points = [checked_point(MetricPoint("loss", k, v)) for k, v in HISTORIES[position].items()]
        with db.session(one_statement=True) as s:
            record_metrics(s, job.id, attempt, points)
    return job_ids


def _expected(history: dict[int, float], mode: str) -> float | None:
    """The objective as the trials table shows it: the best non-NaN value, None if that is
    not finite or there is none."""
    numbers = [v for v in history.values() if not math.isnan(v)]
    if not numbers:
        return None
    best = max(numbers) if mode == "max" else min(numbers)
    return best if math.isfinite(best) else None


@pytest.mark.parametrize("mode", ["min", "max"])
def test_at_best_ranks_trials_by_their_current_best_point(
    db: Database, settings: Settings, mode: str
) -> None:
    sweep_id = _sweep(db, settings, mode)
    job_ids = _run_trials(db, sweep_id)
    histories = [dict(h) for h in HISTORIES]
    # The resumed trial's second attempt trains again after RESUME_STEP: its later points
    # are no longer the trial's.
    with db.session() as s:
        supersede_after_resume(s, job_ids[RESUMED], 2, RESUME_STEP)
    histories[RESUMED] = {k: v for k, v in histories[RESUMED].items() if k <= RESUME_STEP}

    with db.session(write=False) as s:
        sweep = s.get(Sweep, sweep_id)
        assert sweep is not None
        shown = {t.position: t.objective_value for t in view.list_trials(s, sweep)}
        best = view.best_trial(s, sweep)
    want = {pos: _expected(h, mode) for pos, h in enumerate(histories)}
    assert shown == want
    # min: trial 0 (0.5; trial 2's 0.1 was superseded, trial 1's -inf shows no value).
    # max: trial 1 (4.0; trial 2's 7.5 was superseded).
    assert best is not None and best.position == {"min": 0, "max": 1}[mode], (best, want)
