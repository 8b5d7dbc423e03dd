"""The sink's side of the job's metric-name quota (``DDPQ_METRIC_NAMES_PER_JOB``).

The API refuses a whole batch that would bring the job past its quota of distinct names
(422 ``quota_exceeded``, nothing of it stored). Resending the same batch can never succeed,
and dropping it would lose the points of names the job already has. So once refused, the
sink keeps sending only the names this attempt has had stored: the refused batch is sent
again without its new names, and later points of new names are dropped before they are
sent (counted and logged once). A script that reports names without end (a bug or a hostile
one) then costs the API nothing past the quota.

A resumed attempt starts knowing no names: when a refused batch holds none it has had
stored, its names are tried one per request (once per attempt), so the names an earlier
attempt stored go on. A name an earlier attempt stored that this one first reports after the
quota was reached is dropped (known limit).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from service.core.metrics.points import CheckedPoint
from service.core.owners.quotas import METRIC_NAMES_SETTING

log = logging.getLogger(__name__)


def is_names_refusal(answer_code: str, detail: str) -> bool:
    """Whether an attempt API refusal (its ``code`` and text) is the metric-name quota's."""
    return answer_code == "quota_exceeded" and METRIC_NAMES_SETTING in detail


class NameQuota:
    """The names this attempt has had stored, and whether the job is at its name quota.
    Used by the sink's writer thread and its flushing thread: sets, ints and a bool, each
    update one assignment or one ``set.update`` under the GIL."""

    def __init__(self) -> None:
        self.stored: set[str] = set()
        self.full = False
        self.dropped = 0  # points not sent: their names are past the quota
        self._probing = 0  # points still to send one name per request
        self._probed = False

    def next_batch(self, batch: list[CheckedPoint]) -> list[CheckedPoint]:
        """``batch`` (the backlog's oldest points) cut to its first name's points while the
        names of a refused batch are being tried one by one; else as it is."""
        if self._probing <= 0 or not batch:
            return batch
        first, n = batch[0].name, 1
        while n < len(batch) and batch[n].name == first:
            n += 1
        return batch[:n]

    def note_stored(self, points: Sequence[CheckedPoint]) -> None:
        """``points`` were taken by the API: their names are the job's."""
        self.stored.update(p.name for p in points)
        self._probing = max(0, self._probing - len(points))

    def refused(self, batch: list[CheckedPoint]) -> list[CheckedPoint]:
        """The API refused ``batch`` for the name quota: the points to send in its place
        (oldest first; empty: drop it). Its points of names already stored go again; when it
        holds none (a resumed attempt, whose names an earlier attempt stored), its names are
        tried one per request, once per attempt, so those the job has go on."""
        if self._probing > 0:  # one name, past the quota
            self._probing = max(0, self._probing - len(batch))
            self.dropped += len(batch)
            return []
        if not self.full:
            log.warning("the job is at its metric-name quota (%s): only the %d names already "
                        "stored are sent from now on",
                        METRIC_NAMES_SETTING, len(self.stored))  # fmt: skip
        self.full = True
        kept = [p for p in batch if p.name in self.stored]
        if kept or self._probed:
            self.dropped += len(batch) - len(kept)
            return kept
        self._probed = True
        order = {name: i for i, name in enumerate(dict.fromkeys(p.name for p in batch))}
        grouped = sorted(batch, key=lambda p: order[p.name])  # stable: steps keep their order
        self._probing = len(grouped)
        return grouped

    def admit(self, points: list[CheckedPoint]) -> list[CheckedPoint]:
        """``points`` less those of names past the quota (all of them until it is reached)."""
        if not self.full:
            return points
        kept = [p for p in points if p.name in self.stored]
        self.dropped += len(points) - len(kept)
        return kept
