"""Route of a job's lost-work (goodput) ledger: where its wall time went, per attempt."""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from service.api.deps import REQUIRE_CALLER, UNAUTHORIZED, ContextDep
from service.api.http import ERRORS, JobIdPath
from service.core.goodput import PHASES
from service.store.attempts.values import AttemptLedger, JobLedger
from service.store.jobs import service as jobs

router = APIRouter(tags=["goodput"], dependencies=[REQUIRE_CALLER], responses=UNAUTHORIZED)


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class PhasesOut(_Out):
    """Seconds of each phase (they add up to the attempt's, or the job's, wall time)."""

    queued_s: float = Field(description="Queued → claimed by a worker.")
    starting_s: float = Field(description="Claimed → first step, less restore.")
    restore_s: float = Field(description="Finding, verifying and loading the checkpoint.")
    productive_s: float = Field(description="Training time of the steps that count.")
    checkpoint_stall_s: float = Field(description="The training loop waiting on saves.")
    lost_s: float = Field(description="Training time of steps a later resume threw away.")
    in_progress_s: float = Field(
        description="Last step → now, while the attempt still runs (not yet productive or "
        "teardown)."
    )
    teardown_s: float = Field(description="Last step → the attempt ended.")


class AttemptGoodputOut(PhasesOut):
    """One attempt: its moments, how it ended, its steps and phases. ``lost_steps_range`` is
    the inclusive range of its steps that ``superseded_by`` (a later attempt, resuming from an
    earlier checkpoint) trained again."""

    attempt: int
    outcome: str
    enqueued_at: datetime
    claimed_at: datetime | None
    training_started_at: datetime | None
    ended_at: datetime | None = Field(description="None while the attempt lasts.")
    resume_step: int | None = Field(description="Checkpoint step resumed from (0: scratch).")
    first_step: int | None
    last_step: int | None
    lost_steps: int
    lost_steps_range: tuple[int, int] | None
    superseded_by: int | None
    wall_s: float


class IntervalOut(_Out):
    """The checkpoint interval minimising expected lost work (Young/Daly: ``sqrt(2 × save
    cost × MTBF)``), an estimate from this job's own measurements."""

    estimate: bool = True
    formula: str = "sqrt(2 × save_cost_s × mtbf_s)"
    save_cost_s: float
    mtbf_s: float
    interval_s: float
    interval_steps: int | None
    current_interval_steps: int | None


class GoodputOut(PhasesOut):
    """A job's ledger: totals per phase (adding up to ``wall_s``, the seconds since
    submission, to the end or to ``as_of``), goodput = productive / wall, every attempt."""

    job_id: int
    state: str
    as_of: datetime
    wall_s: float
    goodput: float | None = Field(
        description="productive_s / wall_s; null while no attempt has reported a step (a "
        "job that reports none, such as a script without ddpq.report or --tensorboard, has "
        "no productive time to measure)."
    )
    lost_steps: int
    attempts: list[AttemptGoodputOut]
    checkpoint_interval: IntervalOut | None


def _phases(values: dict[str, float]) -> dict[str, float]:
    return {f"{p}_s": round(values[p], 6) for p in PHASES}


def _attempt_out(line: AttemptLedger) -> AttemptGoodputOut:
    p = line.phases
    return AttemptGoodputOut(
        attempt=line.attempt,
        outcome=line.outcome,
        enqueued_at=line.enqueued_at,
        claimed_at=line.claimed_at,
        training_started_at=line.training_started_at,
        ended_at=line.ended_at,
        resume_step=line.resume_step,
        first_step=line.first_step,
        last_step=line.last_step,
        lost_steps=p.lost_steps,
        lost_steps_range=p.lost_steps_range,
        superseded_by=line.superseded_by,
        wall_s=round(p.total, 6),
        **_phases({k: getattr(p, k) for k in PHASES}),
    )


def goodput_out(ledger: JobLedger) -> GoodputOut:
    """The ledger as the API shows it (seconds rounded to microseconds)."""
    interval = ledger.interval
    return GoodputOut(
        job_id=ledger.job_id,
        state=ledger.state,
        as_of=ledger.as_of,
        wall_s=round(ledger.wall_s, 6),
        goodput=ledger.goodput,
        lost_steps=ledger.lost_steps,
        attempts=[_attempt_out(line) for line in ledger.attempts],
        checkpoint_interval=(
            IntervalOut(
                save_cost_s=interval.save_cost_s,
                mtbf_s=interval.mtbf_s,
                interval_s=interval.interval_s,
                interval_steps=interval.interval_steps,
                current_interval_steps=interval.current_interval_steps,
            )
            if interval is not None
            else None
        ),
        **_phases(ledger.totals),
    )


@router.get(
    "/jobs/{job_id}/goodput",
    response_model=GoodputOut,
    summary="Where the job's wall time went (goodput, lost work)",
    responses=ERRORS,
)
def goodput_route(job_id: JobIdPath, ctx: ContextDep) -> GoodputOut:
    """The job's lost-work ledger: per attempt and in total, seconds queued, starting,
    restoring, training productively, stalled on checkpoints, lost (steps a later resume threw
    away) and tearing down, adding up to the wall time since submission; goodput =
    productive / wall; and the Young/Daly checkpoint interval estimate once a failure and a
    save were measured.

    Who may call it: the job's owner or an admin (another owner: 404, as ``GET /jobs/{id}``);
    an attempt token: 401.
    """
    return goodput_out(jobs.get_goodput(ctx.db, job_id, owner=ctx.owner))
