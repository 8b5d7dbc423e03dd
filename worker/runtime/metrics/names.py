"""The sink's side of the job's metric-name quota (``DDPQ_METRIC_NAMES_PER_JOB``).

The API refuses a whole batch that would bring the job past its quota of distinct names
(422 ``quota_exceeded``, nothing of it stored). Resending the same batch can never succeed,
and dropping it would lose the points of names the job already has. So once refused, the
sink keeps sending only the names this attempt has had stored: the refused batch is sent
again without its new names, and later points of new names are dropped before they are
sent (counted and logged once). A script that reports names without end (a bug or a hostile
one) then costs the API nothing past the quota.

A resumed attempt knows only the names it has had stored itself: once the quota is reached,
a name only an earlier attempt stored is dropped too until this attempt has sent it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from service.core.metrics.points import CheckedPoint

log = logging.getLogger(__name__)

# What names the quota's refusal: the setting named in its answer (``QuotaHit.words``).
NAMES_SETTING = "DDPQ_METRIC_NAMES_PER_JOB"


def is_names_refusal(answer_code: str, detail: str) -> bool:
    """Whether an attempt API refusal (its ``code`` and text) is the metric-name quota's."""
    return answer_code == "quota_exceeded" and NAMES_SETTING in detail


class NameQuota:
    """The names this attempt has had stored, and whether the job is at its name quota.
    Used by the sink's writer thread and its flushing thread: sets and a bool, each update
    one assignment or one ``set.update`` under the GIL."""

    def __init__(self) -> None:
        self.stored: set[str] = set()
        self.full = False
        self.dropped = 0  # points not sent: their names are past the quota

    def note_stored(self, points: Sequence[CheckedPoint]) -> None:
        """``points`` were taken by the API: their names are the job's."""
        self.stored.update(p.name for p in points)

    def reached(self) -> None:
        """The API refused a batch for the name quota: only stored names go on."""
        if not self.full:
            log.warning("the job is at its metric-name quota (%s): only the %d names already "
                        "stored are sent from now on", NAMES_SETTING, len(self.stored))  # fmt: skip
        self.full = True

    def admit(self, points: list[CheckedPoint]) -> list[CheckedPoint]:
        """``points`` less those of names past the quota (all of them until it is reached)."""
        if not self.full:
            return points
        kept = [p for p in points if p.name in self.stored]
        self.dropped += len(points) - len(kept)
        return kept
