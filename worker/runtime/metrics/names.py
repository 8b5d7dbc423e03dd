"""The sink's side of the job's metric-name quota (``DDPQ_METRIC_NAMES_PER_JOB``).

The API refuses a whole batch that would bring the job past its quota of distinct names
(422 ``quota_exceeded``, nothing of it stored), and its answer lists those of the batch's
names the job already has (``stored_names``: an earlier attempt may have stored them).
Resending the same batch can never succeed, and dropping it would lose the points of names
the job already has. So once refused, the sink keeps sending only names the job has: the
refused batch is sent again with only those names' points, and later points of other names
are dropped before they are sent (counted and logged once). A script that reports names
without end (a bug or a hostile one) then costs the API one refused request past the quota.

A name an earlier attempt stored that this one first reports after the quota was reached,
in a later batch than the refused one, is dropped (known limit). So is every point of an
attempt that knows no name yet when an API older than ``stored_names`` refuses its batch:
upgrade the API before the workers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from service.core.metrics.points import CheckedPoint
from service.core.owners.quotas import METRIC_NAMES_SETTING

log = logging.getLogger(__name__)


def is_names_refusal(answer_code: str, detail: str) -> bool:
    """Whether an attempt API refusal (its ``code`` and text) is the metric-name quota's."""
    return answer_code == "quota_exceeded" and METRIC_NAMES_SETTING in detail


class NameQuota:
    """The names the job is known to have, and whether it is at its name quota. Used by the
    sink's writer thread and its flushing thread: sets, ints and a bool, each update one
    assignment or one ``set.update`` under the GIL."""

    def __init__(self) -> None:
        self.stored: set[str] = set()
        self.full = False
        self.dropped = 0  # points not sent: their names are past the quota

    def note_stored(self, points: Sequence[CheckedPoint]) -> None:
        """``points`` were taken by the API: their names are the job's."""
        self.stored.update(p.name for p in points)

    def refused(
        self, batch: list[CheckedPoint], stored_names: Iterable[str] | None
    ) -> list[CheckedPoint]:
        """The API refused ``batch`` for the name quota; ``stored_names``, from its answer,
        are those of the batch's names the job has (None from an API that does not say: then
        only names this attempt had stored count). The points to send in the batch's place
        (oldest first, the batch's order; empty: drop it)."""
        if stored_names is not None:  # the API's word on this batch's names wins
            answered = set(stored_names)
            self.stored -= {p.name for p in batch} - answered
            self.stored |= answered
        if not self.full:
            log.warning("the job is at its metric-name quota (%s): only the %d names it has "
                        "are sent from now on",
                        METRIC_NAMES_SETTING, len(self.stored))  # fmt: skip
        self.full = True
        kept = [p for p in batch if p.name in self.stored]
        if len(kept) == len(batch):  # refused though every name is the job's: never loop
            kept = []
        self.dropped += len(batch) - len(kept)
        return kept

    def admit(self, points: list[CheckedPoint]) -> list[CheckedPoint]:
        """``points`` less those of names past the quota (all of them until it is reached)."""
        if not self.full:
            return points
        kept = [p for p in points if p.name in self.stored]
        self.dropped += len(points) - len(kept)
        return kept


def answered_names(answer: dict[str, object]) -> list[str] | None:
    """The name quota refusal's ``stored_names`` (strings only), None when it has none."""
    names = answer.get("stored_names")
    if not isinstance(names, list):
        return None
    return [n for n in names if isinstance(n, str)]
