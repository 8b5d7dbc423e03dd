"""A reported metric point, and what one must be to be stored alike on SQLite and PostgreSQL."""

from __future__ import annotations

import math
import operator
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import SupportsIndex

from service.core.limits import MAX_METRIC_NAME_CHARS

JsonNumber = float | str | None

# models.Metric.name is VARCHAR(100) (PostgreSQL refuses longer names; SQLite would keep them).
# The dashboard pages through a series by step in JavaScript numbers, exact up to 2**53 - 1.
MAX_STEP = 2**53 - 1
# models.Metric.epoch is a 32-bit INTEGER.
MAX_EPOCH = 2**31 - 1
# models.Metric.ranks is a SMALLINT.
MAX_RANKS = 2**15 - 1


# How a point's value was made (``MetricPoint.ranks``): rank 0's own, not averaged.
RANK0_ONLY = 0


@dataclass(frozen=True)
class MetricPoint:
    """One reported scalar: ``name`` at global ``step`` (1-based), in ``epoch`` (0-based).

    ``ranks`` says how the value was made: N ≥ 1 the mean (or a reduction) over N ranks,
    ``RANK0_ONLY`` (0) rank 0's own value on a job of several ranks, None unknown.
    """

    name: str
    step: int
    value: float
    epoch: int | None = None
    time: datetime | None = None
    ranks: int | None = None


def point_agg(ranks: int | None) -> dict[str, str | int | None]:
    """How a stored point was made, as the API tells it: ``{"agg": "mean", "ranks": N}``,
    ``{"agg": "rank0"}``, or ``{"agg": None}`` for a point that does not say."""
    if ranks is None:
        return {"agg": None}
    if ranks == RANK0_ONLY:
        return {"agg": "rank0"}
    return {"agg": "mean", "ranks": ranks}


def json_safe(value: float | None) -> JsonNumber:
    """A float as a JSON-valid value: finite → float, NaN/NULL → None, ±inf → "±Infinity"."""
    if value is None or math.isnan(value):
        return None
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return float(value)


class CheckedPoint(MetricPoint):
    """A point as both databases store it alike: the only type ``record_metrics`` takes.

    Build one only with ``checked_point`` (the one place the rules are applied); every
    writer (the rank-0 sink, the ingest benchmark, the API) turns what it got into these
    before it writes. Compares equal to a ``MetricPoint`` with the same fields.
    ``dataclasses.replace`` would keep the class without a check: build a ``MetricPoint`` and
    check it again to change a field.
    """

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MetricPoint):
            return NotImplemented
        return (self.name, self.step, self.value, self.epoch, self.time, self.ranks) == (
            other.name, other.step, other.value, other.epoch, other.time, other.ranks,
        )  # fmt: skip

    __hash__ = MetricPoint.__hash__


def _check_name(name: object) -> None:
    """Raises ValueError unless ``name`` is a storable metric name (see ``checked_point``)."""
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_METRIC_NAME_CHARS:
        raise ValueError(f"metric name {name!r:.120}: must be 1-{MAX_METRIC_NAME_CHARS} characters")
    if "\x00" in name or (not name.isprintable() and _has_lone_surrogate(name)):
        raise ValueError(f"metric name {name!r:.120}: NUL or a lone surrogate cannot be stored")


def _checked_step_epoch(
    name: str, step: SupportsIndex, epoch: SupportsIndex | None
) -> tuple[int, int | None]:
    """``step`` and ``epoch`` as Python ints after the range checks of ``checked_point``."""
    try:
        step_ = operator.index(step)
        epoch_ = None if epoch is None else operator.index(epoch)
    except TypeError as exc:
        raise ValueError(f"metric {name!r} at step {step!r}: {exc}") from None
    if not 1 <= step_ <= MAX_STEP:
        raise ValueError(f"metric {name!r}: step {step_} is outside 1..{MAX_STEP} (1-based)")
    if epoch_ is not None and not 0 <= epoch_ <= MAX_EPOCH:
        raise ValueError(
            f"metric {name!r} at step {step_}: epoch {epoch_} is outside 0..{MAX_EPOCH}"
        )
    return step_, epoch_


# How many good names a caller's ``known_names`` remembers (a loop that makes up names must
# not grow it without end).
MAX_KNOWN_NAMES = 10_000


def checked_report(
    step: SupportsIndex,
    epoch: SupportsIndex | None,
    names: Collection[str],
    known_names: set[str] | None = None,
) -> tuple[int, int | None]:
    """The (step, epoch) of one ``TrainContext.report`` call as Python ints, after checking
    them and every one of ``names`` (the call's metric names) by ``checked_point``'s rules,
    so a bad report raises in the caller's loop. Values are not checked here.

    Called on every training step: ``known_names`` is the caller's own record of names that
    passed (a str is immutable: once good, always good); good names are added to it, up to
    ``MAX_KNOWN_NAMES``. Plain ints in range take no further call.

    Raises:
        ValueError: a name, step or epoch ``checked_point`` would refuse (same message; the
            step and epoch are named after the first name, or "step" when there is none).
    """
    for name in names:
        if known_names is None or name not in known_names:
            _check_name(name)
            if known_names is not None and len(known_names) < MAX_KNOWN_NAMES:
                known_names.add(name)
    if (
        type(step) is int
        and 1 <= step <= MAX_STEP
        and (epoch is None or (type(epoch) is int and 0 <= epoch <= MAX_EPOCH))
    ):
        return step, epoch
    return _checked_step_epoch(next(iter(names), "step"), step, epoch)


def checked_point(point: MetricPoint) -> CheckedPoint:
    """``point`` as both databases store it alike: ``step``/``epoch`` as Python ints (numpy
    integers accepted), ``value`` as a float with -0.0 as 0.0 (SQLite cannot keep the sign),
    ``time`` converted to UTC. The one constructor of ``CheckedPoint``s; one given is
    returned as it is (checking is idempotent).

    Raises:
        ValueError: a name that is empty, over ``MAX_METRIC_NAME_CHARS`` characters, or holds NUL or
            a lone surrogate; a step outside 1..``MAX_STEP``; an epoch outside
            0..``MAX_EPOCH``; a value that is not a number; a naive ``time``; ``ranks``
            outside 0..``MAX_RANKS``. The message
            names the point.
    """
    if type(point) is CheckedPoint:
        return point
    name = point.name
    _check_name(name)
    try:
        step = operator.index(point.step)
        epoch = None if point.epoch is None else operator.index(point.epoch)
        value = float(point.value) + 0.0  # + 0.0: -0.0 becomes 0.0, NaN and ±inf stay
    except (TypeError, ValueError) as exc:
        raise ValueError(f"metric {name!r} at step {point.step!r}: {exc}") from None
    step, epoch = _checked_step_epoch(name, step, epoch)
    at = point.time
    if at is not None:
        if at.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        at = at.astimezone(UTC)
    ranks = point.ranks
    if ranks is not None:
        try:
            ranks = operator.index(ranks)
        except TypeError as exc:
            raise ValueError(f"metric {name!r} at step {step}: ranks: {exc}") from None
        if not 0 <= ranks <= MAX_RANKS:
            raise ValueError(
                f"metric {name!r} at step {step}: ranks {ranks} is outside 0..{MAX_RANKS}"
            )
    return CheckedPoint(name, step, value, epoch, at, ranks)


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def split_points(points: Iterable[MetricPoint]) -> tuple[list[CheckedPoint], list[str]]:
    """``points`` through ``checked_point``: the storable ones, and why each other one was
    refused (for a writer that must keep going past a bad point, e.g. the rank-0 sink)."""
    good: list[CheckedPoint] = []
    refused: list[str] = []
    for point in points:
        try:
            good.append(checked_point(point))
        except ValueError as exc:
            refused.append(str(exc))
    return good, refused
