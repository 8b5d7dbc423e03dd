"""Job states and the one table of allowed transitions.

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
