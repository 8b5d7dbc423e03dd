"""The values attempt use cases take and hand out: plain, frozen, no ORM row."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from service.core.goodput import AttemptPhases, IntervalEstimate


@dataclass(frozen=True, slots=True)
class AttemptRef:
    """The attempt an attempt token stands for (not a proof that it is still current)."""

    job_id: int
    attempt: int


@dataclass(frozen=True, slots=True)
class TimelineUpdate:
    """Fields of one timeline report; None leaves the stored value as it is.

    ``resume_step``: checkpoint step resumed from (0: from scratch); only the first one told
    is kept. ``restore_s`` and ``checkpoint_stall_s`` in seconds; ``training_started_at``
    tz-aware UTC.
    """

    resume_step: int | None = None
    restore_s: float | None = None
    training_started_at: datetime | None = None
    checkpoint_stall_s: float | None = None
    checkpoint_saves: int | None = None


@dataclass(frozen=True, slots=True)
class AttemptLedger:
    """One attempt's line of the ledger: its moments (None when unknown), how it ended (in
    words; ``requeued``: by a requeue, whatever its kind), the steps it trained and the phases
    (``service.core.goodput.AttemptPhases``)."""

    attempt: int
    outcome: str
    enqueued_at: datetime
    claimed_at: datetime | None
    training_started_at: datetime | None
    ended_at: datetime | None
    resume_step: int | None
    first_step: int | None
    last_step: int | None
    superseded_by: int | None
    phases: AttemptPhases
    requeued: bool = False


@dataclass(frozen=True, slots=True)
class JobLedger:
    """A job's ledger as of ``as_of``: every attempt, the totals per phase (seconds, they add
    up to ``wall_s``, the seconds since submission) and goodput = productive / wall.
    ``interval``: the Young/Daly estimate, None until a failure and a save were measured."""

    job_id: int
    state: str
    as_of: datetime
    wall_s: float
    goodput: float | None
    totals: dict[str, float]
    lost_steps: int
    attempts: list[AttemptLedger]
    interval: IntervalEstimate | None
