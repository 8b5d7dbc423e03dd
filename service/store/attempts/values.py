"""The values attempt use cases take and hand out: plain, frozen, no ORM row."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


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
