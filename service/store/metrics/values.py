"""The values metric use cases hand out: a page of points, and the row shapes it holds.

Points travel as Core rows (tuples by position and by name), not ORM objects and not one
dataclass each: loading 1,000 ORM entities cost 5x the plain rows per poll, and the
serialiser unpacks the tuples directly (``service.api.metrics.schemas``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TypeAlias

from sqlalchemy import Row

# A current point: ``.step``, ``.epoch``, ``.value`` (None for NaN), ``.time``, ``.attempt``
# and ``.ranks`` (``Metric.ranks``). Every column is in the PostgreSQL primary key's INCLUDE
# list, so a poll stays an index-only scan.
# A string: ``Row[int, …]`` is SQLAlchemy 2.1's variadic form (2.0 would refuse it at import).
PointRow: TypeAlias = "Row[int, int | None, float | None, datetime, int, int | None]"
# A superseded point: the columns of ``PointRow`` and ``.superseded_by`` (the attempt that
# trained its step again).
SupersededRow: TypeAlias = "Row[int, int | None, float | None, datetime, int, int | None, int]"


@dataclass(frozen=True, slots=True)
class MetricPage:
    """Points of metric ``name``, ascending by step: ``points`` (the current ones),
    ``superseded`` (None unless asked for) and where the next poll continues
    (``next_after_step``)."""

    name: str
    points: Sequence[PointRow]
    superseded: Sequence[SupersededRow] | None
    next_after_step: int
