"""Job states, sweep states and trial outcomes, each with the one table of its transitions.

Lifecycle::

    queued ──► starting ──► running ──► succeeded | failed | cancelled
      │           │  ▲         │
      │           └──┴─────────┴──► queued   (relaunch: worker lost, retryable failure,
      │                                       preemption; attempt + 1)
      └──► cancelled                          (cancel of a job no worker holds yet)

``starting`` means a worker holds the job and is launching it (or Slurm has it PENDING);
``running`` means rank processes exist. ``starting`` may end directly when the worker (or
Slurm's accounting) never saw the ranks run. Cancel is a flag (``cancel_requested``), not a
state: the worker that holds the job turns it into ``cancelled``. Terminal states never change.

A sweep::

    running ──► succeeded | failed | cancelled
       ▲           │         │
       └───────────┴─────────┘   (trials added to it, or its failed trials retried)

A sweep is ``running`` while any trial's job has not ended; then ``succeeded`` if one trial
succeeded and nothing stopped it (``max_failed``), else ``failed``. Only ``cancelled`` is
final. A trial's outcome is its newest job's state, except ``stopped_early`` once early
stopping (ASHA) flagged its active job to stop; a failed trial goes back to ``queued`` when it
is retried (a new job).
"""

from __future__ import annotations

from enum import StrEnum

from service.core.errors import InvalidTransitionError


class JobState(StrEnum):
    """The state of a job (see the module docstring for the lifecycle)."""

    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        """True for succeeded, failed and cancelled."""
        return self in TERMINAL_STATES


TERMINAL_STATES: frozenset[JobState] = frozenset(
    {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
)
ACTIVE_STATES: frozenset[JobState] = frozenset({JobState.STARTING, JobState.RUNNING})

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.STARTING, JobState.CANCELLED}),
    JobState.STARTING: frozenset(
        {
            JobState.RUNNING,
            JobState.QUEUED,
            JobState.SUCCEEDED,
            JobState.FAILED,
            JobState.CANCELLED,
        }
    ),
    JobState.RUNNING: frozenset(
        {JobState.QUEUED, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


def can_transition(expected: JobState, target: JobState) -> bool:
    """Whether ``expected → target`` is in the transition table."""
    return target in TRANSITIONS[expected]


def check_transition(expected: JobState, target: JobState) -> None:
    """Raise InvalidTransitionError unless ``expected → target`` is allowed."""
    if not can_transition(expected, target):
        allowed = ", ".join(sorted(TRANSITIONS[expected])) or "none (terminal)"
        raise InvalidTransitionError(
            f"cannot move a job from {expected} to {target}; allowed from {expected}: {allowed}"
        )


class SweepState(StrEnum):
    """The state of a sweep (see the module docstring for its lifecycle)."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def has_ended(self) -> bool:
        """True for succeeded, failed and cancelled (only cancelled is final)."""
        return self in ENDED_SWEEP_STATES


ENDED_SWEEP_STATES: frozenset[SweepState] = frozenset(
    {SweepState.SUCCEEDED, SweepState.FAILED, SweepState.CANCELLED}
)

SWEEP_TRANSITIONS: dict[SweepState, frozenset[SweepState]] = {
    SweepState.RUNNING: frozenset({SweepState.SUCCEEDED, SweepState.FAILED, SweepState.CANCELLED}),
    # New trials, or retried failed ones, run a finished sweep again.
    SweepState.SUCCEEDED: frozenset({SweepState.RUNNING}),
    SweepState.FAILED: frozenset({SweepState.RUNNING}),
    SweepState.CANCELLED: frozenset(),
}


def check_sweep_transition(expected: SweepState, target: SweepState) -> None:
    """Raise InvalidTransitionError unless ``expected → target`` is in ``SWEEP_TRANSITIONS``."""
    if target not in SWEEP_TRANSITIONS[expected]:
        allowed = ", ".join(sorted(SWEEP_TRANSITIONS[expected])) or "none (final)"
        raise InvalidTransitionError(
            f"cannot move a sweep from {expected} to {target}; allowed from {expected}: {allowed}"
        )


class TrialOutcome(StrEnum):
    """What became of a sweep's trial: its newest job's state, or ``stopped_early``. The
    order is the API's order of counts by outcome."""

    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    STOPPED_EARLY = "stopped_early"  # early stopping flagged its job (which ends cancelled,
    # unless it succeeded before the stop reached it: then the trial's outcome is succeeded)


# A trial follows its job's table, and also: early stopping ends an active one (its job then
# ends cancelled, the outcome stays), a retry queues a failed one again (as a new job).
TRIAL_TRANSITIONS: dict[TrialOutcome, frozenset[TrialOutcome]] = {
    TrialOutcome.QUEUED: frozenset({TrialOutcome.STARTING, TrialOutcome.CANCELLED}),
    TrialOutcome.STARTING: frozenset(
        {
            TrialOutcome.RUNNING,
            TrialOutcome.QUEUED,
            TrialOutcome.SUCCEEDED,
            TrialOutcome.STOPPED_EARLY,
            TrialOutcome.FAILED,
            TrialOutcome.CANCELLED,
        }
    ),
    TrialOutcome.RUNNING: frozenset(
        {
            TrialOutcome.QUEUED,
            TrialOutcome.SUCCEEDED,
            TrialOutcome.STOPPED_EARLY,
            TrialOutcome.FAILED,
            TrialOutcome.CANCELLED,
        }
    ),
    TrialOutcome.SUCCEEDED: frozenset(),
    TrialOutcome.STOPPED_EARLY: frozenset(),
    TrialOutcome.FAILED: frozenset({TrialOutcome.QUEUED}),
    TrialOutcome.CANCELLED: frozenset(),
}


def trial_outcome(job_state: str | None, recorded: str | None) -> TrialOutcome:
    """A trial's outcome: the one recorded on the trial (``stopped_early``), else its newest
    job's state; ``cancelled`` for a trial without a job. A job that succeeded all the same
    (the stop came as its last steps ran) makes the trial ``succeeded``: it trained to the
    end, whatever was asked of it."""
    if recorded and job_state != TrialOutcome.SUCCEEDED.value:
        return TrialOutcome(recorded)
    return TrialOutcome(job_state or TrialOutcome.CANCELLED)


def may_be_best(outcome: TrialOutcome, *, cancel_requested: bool) -> bool:
    """Whether a trial's objective value competes for the sweep's best trial: it succeeded
    or was stopped early, or it is still running and not being cancelled. A failed or
    cancelled trial never does, whatever it reported before it ended."""
    if outcome in (TrialOutcome.SUCCEEDED, TrialOutcome.STOPPED_EARLY):
        return True
    return outcome == TrialOutcome.RUNNING and not cancel_requested
