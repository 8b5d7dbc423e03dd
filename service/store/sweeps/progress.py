"""What moves a running sweep on, run by the API's reaper every tick: ``max_failed`` (the
rest of the sweep cancelled, the reason recorded), ASHA early stopping
(``service.core.sweeps.asha``), and the sweep's end state once every trial has ended.

End state: ``failed`` when ``max_failed`` stopped it or no trial succeeded, else
``succeeded`` (a cancelled sweep is ``cancelled`` from the moment it is cancelled; its
``finished_at`` is set once its last trial ended).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ColumnElement, and_, exists, func, or_, select, update
from sqlalchemy.orm import Session

from service.core.events import EventKind, render
from service.core.states import (
    ACTIVE_STATES,
    JobState,
    SweepState,
    TrialOutcome,
    trial_outcome,
)
from service.core.sweeps.asha import decide_at_rung, rung_step, rungs_up_to
from service.core.sweeps.spec import SweepSpec
from service.store.events import record_event
from service.store.models import Job, Metric, Sweep, SweepTrial, utcnow
from service.store.sweeps.crud import (
    cancel_sweep_jobs,
    finish_cancelled,
    is_terminal_state,
    move_sweep,
)

log = logging.getLogger(__name__)
MAX_SWEEPS_PER_TICK = 100


def _unfinished() -> ColumnElement[bool]:
    """Running sweeps, and cancelled ones whose started trials are still stopping."""
    return or_(
        Sweep.state == SweepState.RUNNING.value,
        and_(Sweep.state == SweepState.CANCELLED.value, Sweep.finished_at.is_(None)),
    )


def has_running_sweeps(session: Session) -> bool:
    """Whether any sweep is running, or cancelled and not finished (one read on
    ``ix_sweeps_state``)."""
    return bool(session.scalar(select(exists().where(_unfinished()))))


def advance_sweeps(session: Session) -> list[str]:
    """One pass over the running sweeps (oldest first, at most ``MAX_SWEEPS_PER_TICK``):
    early stopping, ``max_failed``, end states; and a cancelled sweep's ``finished_at`` once
    its last trial ended. Safe to run from several processes: every
    change is a compare-and-set on the job or a write of the sweep's own row.

    Returns:
        One line per thing done (for the log).
    """
    done: list[str] = []
    sweeps = session.scalars(
        select(Sweep).where(_unfinished()).order_by(Sweep.id).limit(MAX_SWEEPS_PER_TICK)
    ).all()
    for sweep in sweeps:
        if sweep.state != SweepState.RUNNING:
            if finish_cancelled(session, sweep):
                done.append(f"sweep {sweep.id} cancelled: every trial has ended")
            continue
        done += advance_sweep(session, sweep)
    session.flush()
    return done


def advance_sweep(session: Session, sweep: Sweep) -> list[str]:
    """``advance_sweeps`` for one sweep."""
    done: list[str] = []
    spec = SweepSpec.model_validate(sweep.spec)
    if spec.early_stop is not None:
        done += evaluate_asha(session, sweep, spec)
    rows = session.execute(
        select(SweepTrial.outcome, Job.state)
        .outerjoin(Job, Job.id == SweepTrial.job_id)
        .where(SweepTrial.sweep_id == sweep.id)
    ).all()
    outcomes = [trial_outcome(state, outcome) for outcome, state in rows]
    failed = outcomes.count(TrialOutcome.FAILED)
    if sweep.max_failed is not None and failed >= sweep.max_failed and sweep.stop_reason is None:
        why = {"sweep_id": sweep.id, "failed": failed, "max_failed": sweep.max_failed}
        reason = render(EventKind.SWEEP_STOPPED, why)
        now_, flagged = cancel_sweep_jobs(session, sweep.id, EventKind.SWEEP_STOPPED, why)
        sweep.stop_reason = reason
        done.append(f"{reason} ({now_} queued, {flagged} running)")
        session.flush()
        return done  # the end state on a later tick, once the running ones stopped
    # Ended: every trial's job is (a stopped trial's job ends cancelled once its worker
    # stopped it; until then the sweep runs).
    if rows and all(is_terminal_state(state) for _, state in rows):
        succeeded = TrialOutcome.SUCCEEDED in outcomes
        failed_ = sweep.stop_reason or not succeeded
        move_sweep(sweep, SweepState.FAILED if failed_ else SweepState.SUCCEEDED)
        sweep.finished_at = utcnow()
        done.append(f"sweep {sweep.id} {sweep.state}")
    session.flush()
    return done


@dataclass(frozen=True)
class _Arrival:
    """A trial's objective at a rung it reached, not yet decided."""

    at: datetime
    rung: int
    trial: SweepTrial
    job_id: int
    job_state: str
    attempt: int
    value: float


def evaluate_asha(session: Session, sweep: Sweep, spec: SweepSpec) -> list[str]:
    """Record the objective of every trial at each rung it reached since the last pass, and
    stop those not in the top ``1/reduction_factor`` of their rung (``core.asha``).
    Arrivals are decided in the order their rung's point was written: each against those
    that reached the rung before it. A stopped trial's job gets ``cancel_requested`` and an
    event with the numbers; the trial's outcome becomes ``stopped_early``.
    """
    assert spec.early_stop is not None
    asha = spec.early_stop.asha
    metric, mode, at = (sweep.objective[k] for k in ("metric", "mode", "at"))
    rows = session.execute(
        select(SweepTrial, Job.id, Job.state, Job.attempt, Job.cancel_requested)
        .join(Job, Job.id == SweepTrial.job_id)
        .where(SweepTrial.sweep_id == sweep.id, Job.state != JobState.QUEUED.value)
    ).all()
    recorded: dict[int, list[float]] = {}
    for trial, *_ in rows:
        for rung_name, value in (trial.rungs or {}).items():
            recorded.setdefault(int(rung_name), []).append(_float(value))
    last_steps = (
        dict(
            session.execute(
                select(Metric.job_id, func.max(Metric.step))
                .where(Metric.job_id.in_([r[1] for r in rows]), Metric.name == metric)
                .group_by(Metric.job_id)
            ).all()
        )
        if rows
        else {}
    )
    arrivals: list[_Arrival] = []
    for trial, job_id, state, attempt, _ in rows:
        if trial.outcome == TrialOutcome.STOPPED_EARLY:
            continue
        seen = trial.rungs or {}
        for rung in rungs_up_to(
            asha.rung_steps, asha.reduction_factor, last_steps.get(job_id) or 0
        ):
            if str(rung) in seen:
                continue
            step = rung_step(asha.rung_steps, asha.reduction_factor, rung)
            point = _value_at(session, job_id, metric, step, mode, at)
            if point is not None:
                arrivals.append(_Arrival(point[0], rung, trial, job_id, state, attempt, point[1]))
    done: list[str] = []
    stopped: set[int] = set()
    for a in sorted(arrivals, key=lambda a: (a.rung, a.at, a.job_id)):
        if a.job_id in stopped:
            continue
        step = rung_step(asha.rung_steps, asha.reduction_factor, a.rung)
        decision = decide_at_rung(
            a.value,
            recorded.get(a.rung, []),
            rung=a.rung,
            step=step,
            mode=mode,
            reduction_factor=asha.reduction_factor,
        )
        recorded.setdefault(a.rung, []).append(a.value)
        a.trial.rungs = {**(a.trial.rungs or {}), str(a.rung): _json_number(a.value)}
        if decision.stop and a.job_state in {s.value for s in ACTIVE_STATES}:
            data = decision.event_data(metric, asha.reduction_factor)
            message = decision.message(metric, asha.reduction_factor)
            if _stop_trial(session, a, data):
                stopped.add(a.job_id)
                done.append(f"job_id={a.job_id} {message}")
    session.flush()
    return done


def _value_at(
    session: Session, job_id: int, metric: str, step: int, mode: str, at: str
) -> tuple[datetime, float] | None:
    """The objective at rung step ``step``: the newest point at or before it (``at: last``)
    or the best point up to it (``at: best``), with the time the rung's point was written."""
    newest = session.execute(
        select(Metric.time, Metric.value)
        .where(Metric.job_id == job_id, Metric.name == metric, Metric.step <= step)
        .order_by(Metric.step.desc())
        .limit(1)
    ).one_or_none()
    if newest is None:
        return None
    if at == "best":
        agg = func.max(Metric.value) if mode == "max" else func.min(Metric.value)
        best = session.scalar(
            select(agg).where(Metric.job_id == job_id, Metric.name == metric, Metric.step <= step)
        )
        return newest[0], _float(best)
    return newest[0], _float(newest[1])


def _stop_trial(session: Session, a: _Arrival, data: dict[str, object]) -> bool:
    """Flag the trial's job ``cancel_requested`` (compare-and-set on its active state) with an
    ``early_stopped`` event of ``data`` (``RungDecision.event_data``); the trial's outcome
    becomes ``stopped_early``."""
    row = session.execute(
        update(Job)
        .where(
            Job.id == a.job_id,
            Job.state.in_([s.value for s in ACTIVE_STATES]),
            Job.cancel_requested.is_(False),
        )
        .values(cancel_requested=True, updated_at=utcnow())
        .returning(Job.state, Job.attempt)
        .execution_options(synchronize_session=False)
    ).one_or_none()
    if row is None:
        return False
    record_event(
        session, a.job_id, row.attempt, EventKind.EARLY_STOPPED, data, from_state=row.state,
        to_state=row.state,
    )  # fmt: skip
    a.trial.outcome = TrialOutcome.STOPPED_EARLY.value
    return True


def _float(value: object) -> float:
    return float(value) if isinstance(value, int | float) else float("nan")


def _json_number(value: float) -> float | None:
    return None if value != value else value
