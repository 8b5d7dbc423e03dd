"""The goodput ledger of a job, read from what ddpq records: job events (queued, claimed,
ended), ``job_attempts`` (resume step, restore, first step, checkpoint stall), metric points of
every attempt (current and superseded: when each attempt reached its steps) and checkpoints.
The arithmetic is ``service.core.goodput``."""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select, union_all
from sqlalchemy.orm import Session

from service.core.goodput import (
    PHASES,
    AttemptMoments,
    IntervalEstimate,
    attempt_phases,
    lost_from_steps,
    young_daly_interval,
)
from service.core.states import TERMINAL_STATES, JobState
from service.store.attempts.timeline import list_attempt_timelines
from service.store.attempts.values import AttemptLedger, JobLedger
from service.store.jobs.crud import get_job, list_events
from service.store.models import (
    Checkpoint,
    Job,
    JobAttempt,
    JobEvent,
    Metric,
    MetricSuperseded,
    utcnow,
)

_TERMINAL = frozenset(s.value for s in TERMINAL_STATES)


@dataclass
class _Marks:
    enqueued: datetime
    claimed: datetime | None = None
    ended: datetime | None = None
    outcome: str = "queued"
    requeued: bool = False


def _attempt_marks(job: Job, events: list[JobEvent], as_of: datetime) -> dict[int, _Marks]:
    """Each attempt's queued, claimed and ended moments from the job's state events (notes,
    whose state does not change, are skipped)."""
    marks = {1: _Marks(job.created_at)}
    for ev in events:
        if ev.from_state == ev.to_state or ev.from_state is None:
            continue
        if ev.to_state == JobState.QUEUED.value:  # a requeue: attempt ev.attempt - 1 ended
            before = marks.setdefault(ev.attempt - 1, _Marks(job.created_at))
            before.ended, before.outcome = ev.created_at, f"requeued: {ev.reason or 'requeue'}"
            before.requeued = True
            marks[ev.attempt] = _Marks(ev.created_at)
            continue
        m = marks.setdefault(ev.attempt, _Marks(ev.created_at))
        if ev.to_state == JobState.STARTING.value and m.claimed is None:
            m.claimed, m.outcome = ev.created_at, "starting"
        elif ev.to_state == JobState.RUNNING.value:
            m.outcome = "running"
        elif ev.to_state in _TERMINAL:
            m.ended, m.outcome = ev.created_at, ev.to_state
    last = marks[max(marks)]
    if job.state in _TERMINAL and job.finished_at is not None:
        last.ended = job.finished_at  # the job's own end: the wall time ends there
    for m in marks.values():
        if m.ended is None:
            m.ended = as_of
    return marks


def _step_stats(session: Session, job_id: int) -> dict[int, tuple[int, int, datetime, datetime]]:
    """Per attempt: (first step, last step, time of its oldest and of its newest point), over
    current and superseded points alike."""
    parts = [
        select(t.attempt, t.step, t.time).where(t.job_id == job_id)
        for t in (Metric, MetricSuperseded)
    ]
    both = union_all(*parts).subquery()
    rows = session.execute(
        select(
            both.c.attempt,
            func.min(both.c.step),
            func.max(both.c.step),
            func.min(both.c.time),
            func.max(both.c.time),
        ).group_by(both.c.attempt)
    ).all()
    return {int(a): (int(lo), int(hi), t0, t1) for a, lo, hi, t0, t1 in rows}


def _time_at_step(session: Session, job_id: int, attempt: int, step: int) -> datetime | None:
    """When ``attempt`` had reached ``step``: the time of its newest point at or before it."""
    parts = [
        select(t.time).where(t.job_id == job_id, t.attempt == attempt, t.step <= step)
        for t in (Metric, MetricSuperseded)
    ]
    both = union_all(*parts).subquery()
    found: datetime | None = session.scalar(select(func.max(both.c.time)))
    return found


def _ts(at: datetime | None) -> float | None:
    return at.timestamp() if at is not None else None


def job_ledger(session: Session, job_id: int, *, owner: str | None = None) -> JobLedger:
    """The goodput ledger of ``job_id`` now.

    Raises:
        NotFoundError: no such job (or, with ``owner``, not theirs).
    """
    job = get_job(session, job_id, owner=owner)
    as_of = utcnow()
    marks = _attempt_marks(job, list_events(session, job_id), as_of)
    told = list_attempt_timelines(session, job_id)
    stats = _step_stats(session, job_id)
    numbers = sorted(marks)
    resume = [told[n].resume_step if n in told else None for n in numbers]
    later = lost_from_steps(resume)
    lines: list[AttemptLedger] = []
    for n, resume_step, lost_from in zip(numbers, resume, later, strict=True):
        m, t, st = marks[n], told.get(n), stats.get(n)
        first_step, last_step, first_at, last_at = st if st is not None else (None,) * 4
        known_resume = resume_step if resume_step is not None else (
            first_step - 1 if first_step is not None else 0
        )  # fmt: skip
        lost_at = None
        if lost_from is not None and last_step is not None and lost_from > known_resume:
            lost_at = _ts(_time_at_step(session, job_id, n, lost_from))
        started = t.training_started_at if t is not None else None
        assert m.ended is not None
        # Not told (an older rank): its first point is as close to its first step as known.
        began = started if started is not None else first_at
        moments = AttemptMoments(
            enqueued_s=m.enqueued.timestamp(),
            claimed_s=_ts(m.claimed),
            ended_s=m.ended.timestamp(),
            training_started_s=_ts(began),
            last_step_s=_ts(last_at),
            resume_step=known_resume,
            last_step=last_step,
            restore_s=(t.restore_s or 0.0) if t is not None else 0.0,
            checkpoint_stall_s=(t.checkpoint_stall_s or 0.0) if t is not None else 0.0,
            lost_from_step=lost_from,
            lost_from_s=lost_at,
            running=m.ended == as_of,
        )
        superseded_by = next(
            (k for k, r in zip(numbers, resume, strict=True) if k > n and r == lost_from), None
        )
        phases = attempt_phases(moments)
        lines.append(
            AttemptLedger(
                attempt=n,
                outcome=m.outcome,
                enqueued_at=m.enqueued,
                claimed_at=m.claimed,
                training_started_at=started,
                ended_at=m.ended if m.ended != as_of else None,
                resume_step=resume_step,
                first_step=first_step,
                last_step=last_step,
                superseded_by=superseded_by if phases.lost_steps else None,
                phases=phases,
                requeued=m.requeued,
            )
        )
    totals = {p: sum(getattr(line.phases, p) for line in lines) for p in PHASES}
    wall_s = sum(totals.values())
    # Productive time is measured from reported steps: a job that reported none (a script
    # without ddpq.report or --tensorboard) has no goodput to tell, not a goodput of 0.
    measured = wall_s > 0 and any(line.last_step is not None for line in lines)
    return JobLedger(
        job_id=job_id,
        state=job.state,
        as_of=as_of,
        wall_s=wall_s,
        goodput=totals["productive"] / wall_s if measured else None,
        totals=totals,
        lost_steps=sum(line.phases.lost_steps for line in lines),
        attempts=lines,
        interval=_interval(session, job_id, lines, list(told.values())),
    )


def _interval(
    session: Session, job_id: int, lines: list[AttemptLedger], rows: list[JobAttempt]
) -> IntervalEstimate | None:
    """The Young/Daly estimate from this job's measured save cost and failure rate; None
    until both were measured (a save, an attempt that did not finish)."""
    saves = sum(r.checkpoint_saves or 0 for r in rows)
    stall = sum(r.checkpoint_stall_s or 0.0 for r in rows)
    failures = sum(1 for line in lines if line.requeued or line.outcome == JobState.FAILED.value)
    held = sum(line.phases.total - line.phases.queued for line in lines)
    if not saves or not failures or held <= 0:
        return None
    trained = sum(
        (line.last_step or 0) - (line.first_step or 1) + 1 for line in lines if line.last_step
    )
    busy = sum(line.phases.productive + line.phases.lost + line.phases.checkpoint_stall
               for line in lines)  # fmt: skip
    steps = sorted(set(session.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id))))
    gaps = [b - a for a, b in itertools.pairwise(steps)]
    return young_daly_interval(
        stall / saves,
        held / failures,
        step_s=busy / trained if trained > 0 else None,
        current_interval_steps=int(statistics.median(gaps)) if gaps else None,
    )
