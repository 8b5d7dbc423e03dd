"""The lost-work (goodput) ledger's arithmetic: from the moments of each attempt, the seconds
of every phase, the steps thrown away by a later resume, and the checkpoint interval that
would minimise expected lost work. Pure functions over plain values;
``service.store.attempts.goodput`` gathers the moments from the database.

Each attempt's time from the moment it was queued to the moment it ended (or now, while it
lasts) is cut into eight phases that add up to it exactly (every moment is clamped into
order first, so clocks of different hosts cannot make a phase negative):

``queued``   queued → claimed by a worker
``starting`` claimed → first step, less ``restore`` (launch, process group, task build)
``restore``  finding, verifying and loading the checkpoint it resumed from (rank 0 measures)
``productive`` training time of the steps that count (not lost, not stalled)
``checkpoint_stall`` the training loop waiting on checkpoint saves (rank 0 measures)
``lost``     training time of steps a later attempt threw away by resuming from an earlier
             checkpoint
``in_progress`` last step → now, while the attempt still runs: not yet known to be training
             (its next step makes it productive) or teardown, so neither is claimed
``teardown`` last step → the attempt ended (final flush and checkpoint, exit, and for a
             lost worker the time until its lease expired)

The attempts tile the job's life (attempt n + 1 is queued the moment attempt n ends), so the
job's totals add up to its wall time since submission; goodput = productive / wall.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PHASES = (
    "queued",
    "starting",
    "restore",
    "productive",
    "checkpoint_stall",
    "lost",
    "in_progress",
    "teardown",
)


@dataclass(frozen=True)
class AttemptMoments:
    """What is known of one attempt; times in epoch seconds (UTC), None when unknown.

    Attributes:
        enqueued_s: when it was queued (the job's submission, or the requeue that made it).
        claimed_s: when a worker claimed it (None: never claimed).
        ended_s: when it ended (requeued, finished) or now while it lasts.
        running: it has not ended (``ended_s`` is now): the time after its last step is
            ``in_progress``, not ``teardown``.
        training_started_s: when its first step began (rank 0 tells it).
        last_step_s: when its newest step was reported.
        resume_step: the checkpoint step it resumed from (0: from scratch).
        last_step: its newest step (None: it reported none).
        restore_s, checkpoint_stall_s: what rank 0 measured (seconds).
        lost_from_step: its steps after this one were thrown away by a later resume (None:
            none were); ``lost_from_s`` is when it had finished that step (None: before its
            first step, so all its training was lost).
    """

    enqueued_s: float
    claimed_s: float | None
    ended_s: float
    training_started_s: float | None = None
    last_step_s: float | None = None
    resume_step: int = 0
    last_step: int | None = None
    restore_s: float = 0.0
    checkpoint_stall_s: float = 0.0
    lost_from_step: int | None = None
    lost_from_s: float | None = None
    running: bool = False


@dataclass(frozen=True)
class AttemptPhases:
    """Seconds of each phase of one attempt (``PHASES``), and the steps it lost: the inclusive
    range ``lost_steps_range`` (None: none), ``lost_steps`` of them."""

    queued: float
    starting: float
    restore: float
    productive: float
    checkpoint_stall: float
    lost: float
    in_progress: float
    teardown: float
    lost_steps: int
    lost_steps_range: tuple[int, int] | None

    @property
    def total(self) -> float:
        """Seconds from queued to ended (the sum of the phases)."""
        return sum(getattr(self, p) for p in PHASES)


def _clamp(value: float | None, lo: float, hi: float) -> float:
    return lo if value is None else min(max(value, lo), hi)


def attempt_phases(m: AttemptMoments) -> AttemptPhases:
    """Cut one attempt's life into ``PHASES`` (seconds; they add up to ``ended - enqueued``)."""
    start, end = m.enqueued_s, max(m.enqueued_s, m.ended_s)
    if m.claimed_s is None:
        return AttemptPhases(end - start, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, None)
    claimed = _clamp(m.claimed_s, start, end)
    if m.training_started_s is None and m.last_step_s is None:  # never stepped
        return AttemptPhases(claimed - start, end - claimed, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, None)
    first = _clamp(m.training_started_s if m.training_started_s is not None else m.last_step_s,
                   claimed, end)  # fmt: skip
    last = _clamp(m.last_step_s, first, end)
    restore = min(max(m.restore_s, 0.0), first - claimed)
    lost_steps, lost_range, lost_s = 0, None, 0.0
    if m.lost_from_step is not None and m.last_step is not None:
        lost_from = max(m.lost_from_step, m.resume_step)
        if m.last_step > lost_from:
            lost_steps, lost_range = m.last_step - lost_from, (lost_from + 1, m.last_step)
            lost_start = first if m.lost_from_s is None else _clamp(m.lost_from_s, first, last)
            lost_s = last - lost_start
    stall = min(max(m.checkpoint_stall_s, 0.0), (last - first) - lost_s)
    return AttemptPhases(
        queued=claimed - start,
        starting=first - claimed - restore,
        restore=restore,
        productive=(last - first) - lost_s - stall,
        checkpoint_stall=stall,
        lost=lost_s,
        in_progress=end - last if m.running else 0.0,
        teardown=0.0 if m.running else end - last,
        lost_steps=lost_steps,
        lost_steps_range=lost_range,
    )


def lost_from_steps(resume_steps: list[int | None]) -> list[int | None]:
    """For each attempt (in order), the step after which its work was thrown away: the
    smallest resume step told by any later attempt (None: no later attempt told one)."""
    out: list[int | None] = []
    later: int | None = None
    for step in reversed(resume_steps):
        out.append(later)
        if step is not None:
            later = step if later is None else min(later, step)
    return out[::-1]


@dataclass(frozen=True)
class IntervalEstimate:
    """The checkpoint interval that minimises expected lost work, by Young's first-order
    formula: an estimate from this job's own measurements.

    Attributes:
        save_cost_s: mean seconds one checkpoint save held the training loop.
        mtbf_s: mean seconds between failures (time attempts held a worker / interruptions).
        interval_s: ``sqrt(2 × save_cost_s × mtbf_s)``.
        interval_steps: the same in steps (at the job's mean seconds per step), or None.
        current_interval_steps: the job's checkpoint spacing in steps now, or None.
    """

    save_cost_s: float
    mtbf_s: float
    interval_s: float
    interval_steps: int | None
    current_interval_steps: int | None


def young_daly_interval(
    save_cost_s: float,
    mtbf_s: float,
    *,
    step_s: float | None = None,
    current_interval_steps: int | None = None,
) -> IntervalEstimate:
    """The checkpoint interval that minimises expected lost work plus checkpoint cost:
    ``interval ≈ sqrt(2 × save cost × MTBF)`` (seconds).

    Sources: J. W. Young, "A first order approximation to the optimum checkpoint interval",
    Communications of the ACM 17(9):530-531, 1974; J. T. Daly, "A higher order estimate of the
    optimum checkpoint interval for restart dumps", Future Generation Computer Systems
    22(3):303-312, 2006 (whose first-order term is Young's; valid while the save cost is
    small next to the MTBF). An estimate: the MTBF comes from this job's few failures.

    Args:
        save_cost_s: seconds one save costs the training loop (≥ 0).
        mtbf_s: mean seconds between failures (> 0).
        step_s: mean seconds per step, to express the interval in steps.
        current_interval_steps: the job's checkpoint spacing now (passed through).
    Raises:
        ValueError: a negative save cost or a non-positive MTBF.
    """
    if save_cost_s < 0 or not mtbf_s > 0:
        raise ValueError(f"save cost {save_cost_s} s must be ≥ 0 and MTBF {mtbf_s} s > 0")
    interval_s = math.sqrt(2.0 * save_cost_s * mtbf_s)
    steps = max(1, round(interval_s / step_s)) if step_s and step_s > 0 else None
    return IntervalEstimate(save_cost_s, mtbf_s, interval_s, steps, current_interval_steps)
