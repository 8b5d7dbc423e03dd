"""A reported metric point, and what one must be to be stored alike on SQLite and PostgreSQL."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from datetime import UTC, datetime

JsonNumber = float | str | None

# models.Metric.name is VARCHAR(100) (PostgreSQL refuses longer names; SQLite would keep them).
MAX_NAME_CHARS = 100
# The dashboard pages through a series by step in JavaScript numbers, exact up to 2**53 - 1.
MAX_STEP = 2**53 - 1
# models.Metric.epoch is a 32-bit INTEGER.
MAX_EPOCH = 2**31 - 1


@dataclass(frozen=True)
class MetricPoint:
    """One reported scalar: ``name`` at global ``step`` (1-based), in ``epoch`` (0-based)."""

    name: str
    step: int
    value: float
    epoch: int | None = None
    time: datetime | None = None


def json_safe(value: float | None) -> JsonNumber:
    """A float as a JSON-valid value: finite → float, NaN/NULL → None, ±inf → "±Infinity"."""
    if value is None or math.isnan(value):
        return None
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return float(value)


def checked_point(point: MetricPoint) -> MetricPoint:
    """``point`` as both databases store it alike: ``step``/``epoch`` as Python ints (numpy
    integers accepted), ``value`` as a float with -0.0 as 0.0 (SQLite cannot keep the sign),
    ``time`` converted to UTC.

    Raises:
        ValueError: a name that is empty, over ``MAX_NAME_CHARS`` characters, or holds NUL or
            a lone surrogate; a step outside 1..``MAX_STEP``; an epoch outside
            0..``MAX_EPOCH``; a value that is not a number; a naive ``time``. The message
            names the point.
    """
    name = point.name
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_CHARS:
        raise ValueError(f"metric name {name!r:.120}: must be 1-{MAX_NAME_CHARS} characters")
    if "\x00" in name or (not name.isprintable() and _has_lone_surrogate(name)):
        raise ValueError(f"metric name {name!r:.120}: NUL or a lone surrogate cannot be stored")
    try:
        step = operator.index(point.step)
        epoch = None if point.epoch is None else operator.index(point.epoch)
        value = float(point.value) + 0.0  # + 0.0: -0.0 becomes 0.0, NaN and ±inf stay
    except (TypeError, ValueError) as exc:
        raise ValueError(f"metric {name!r} at step {point.step!r}: {exc}") from None
    if not 1 <= step <= MAX_STEP:
        raise ValueError(f"metric {name!r}: step {step} is outside 1..{MAX_STEP} (1-based)")
    if epoch is not None and not 0 <= epoch <= MAX_EPOCH:
        raise ValueError(f"metric {name!r} at step {step}: epoch {epoch} is outside 0..{MAX_EPOCH}")
    at = point.time
    if at is not None:
        if at.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        at = at.astimezone(UTC)
    return MetricPoint(name, step, value, epoch, at)


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def split_points(points: list[MetricPoint]) -> tuple[list[MetricPoint], list[str]]:
    """``points`` through ``checked_point``: the storable ones, and why each other one was
    refused (for a writer that must keep going past a bad point, e.g. the rank-0 sink)."""
    good: list[MetricPoint] = []
    refused: list[str] = []
    for point in points:
        try:
            good.append(checked_point(point))
        except ValueError as exc:
            refused.append(str(exc))
    return good, refused
