"""A metric batch as checked columns (``CheckedColumns``): what the ingest hands the store
when a rank sent ``MetricSeries``, checked by ``checked_point``'s rules a column at a time.

A rank sends one name and a few arrays per series; checking them point by point (a
``MetricPoint`` and a ``CheckedPoint`` each) cost more CPU than the rest of the request. Here
a series whose every point is fine, the common case, is checked with one name check and a
min/max per column; one with any bad point goes through ``checked_point`` point by point, so
the points refused and the words of the refusal are the same as for rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from service.core.metrics.points import (
    MAX_EPOCH,
    MAX_RANKS,
    MAX_STEP,
    CheckedPoint,
    MetricPoint,
    checked_point,
)
from service.core.wire.attempt import MetricSeries, decode_value


@dataclass(frozen=True, slots=True)
class CheckedColumns:
    """Points as columns, every one storable alike on both databases (the rules of
    ``checked_point``): point ``i`` is ``(names[i], steps[i], epochs[i], values[i],
    times[i], ranks[i])``; ``values`` are floats (NaN and ±inf kept, -0.0 made 0.0),
    ``times`` UTC datetimes, or None for "now".

    Build one only with ``checked_columns`` or ``columns_of_points``: the store trusts it.
    """

    names: list[str]
    steps: list[int]
    epochs: list[int | None]
    values: list[float]
    times: list[datetime | None]
    ranks: list[int | None]

    def __len__(self) -> int:
        return len(self.steps)

    def points(self) -> list[CheckedPoint]:
        """The same points as ``CheckedPoint``s (for a writer that takes those)."""
        columns = (self.names, self.steps, self.epochs, self.values, self.times, self.ranks)
        return [
            checked_point(MetricPoint(n, s, v, e, t, r))
            for n, s, e, v, t, r in zip(*columns, strict=True)
        ]


def columns_of_points(points: Iterable[CheckedPoint]) -> CheckedColumns:
    """``CheckedPoint``s (already checked) as columns."""
    pts = list(points)
    return CheckedColumns(
        names=[p.name for p in pts],
        steps=[p.step for p in pts],
        epochs=[p.epoch for p in pts],
        values=[p.value for p in pts],
        times=[p.time for p in pts],
        ranks=[p.ranks for p in pts],
    )


def _column_ok(column: Sequence[int | None], lo: int, hi: int) -> bool:
    """Every item a plain int in ``lo..hi`` (None allowed when ``column`` may hold it)."""
    present = [v for v in column if v is not None]
    return not present or (lo <= min(present) and max(present) <= hi)


def _times_ok(times_s: Sequence[float]) -> bool:
    """Every time finite and one ``datetime.fromtimestamp`` takes (the extremes checked)."""
    if not times_s:
        return True
    if not math.isfinite(sum(times_s)):  # a NaN or an infinity anywhere makes it so
        return False
    try:
        datetime.fromtimestamp(min(times_s), UTC)
        datetime.fromtimestamp(max(times_s), UTC)
    except (ValueError, OverflowError, OSError):
        return False
    return True


def _decoded(values: Sequence[float | str | None]) -> list[float] | None:
    """``values`` as floats (``decode_value``, -0.0 as 0.0); None when one is not a number."""
    out: list[float] = []
    for v in values:
        if type(v) is float:
            out.append(v + 0.0)
            continue
        try:
            out.append(decode_value(v) + 0.0)
        except ValueError:
            return None
    return out


def checked_columns(series: Sequence[MetricSeries]) -> tuple[CheckedColumns, list[str]]:
    """The storable points of ``series`` as columns, and why each other point was refused
    (``series <k> point <i>: …``, both 0-based). A bad point is refused alone.

    The arrays' lengths were checked by ``MetricSeries``.
    """
    names: list[str] = []
    steps: list[int] = []
    epochs: list[int | None] = []
    values: list[float] = []
    times: list[datetime | None] = []
    ranks: list[int | None] = []
    refused: list[str] = []
    for k, s in enumerate(series):
        n = len(s.steps)
        epoch_col: list[int | None] = list(s.epochs) if s.epochs is not None else [None] * n
        decoded = _decoded(s.values)
        fast = (
            decoded is not None
            and _name_ok(s.name)
            and _column_ok(s.steps, 1, MAX_STEP)
            and _column_ok(epoch_col, 0, MAX_EPOCH)
            and (s.ranks is None or 0 <= s.ranks <= MAX_RANKS)
            and _times_ok(s.times_s)
        )
        if fast and decoded is not None:
            names += [s.name] * n
            steps += s.steps
            epochs += epoch_col
            values += decoded
            times += [datetime.fromtimestamp(t, UTC) for t in s.times_s]
            ranks += [s.ranks] * n
        else:
            for i, (step, epoch, raw, time_s) in enumerate(
                zip(s.steps, epoch_col, s.values, s.times_s, strict=True)
            ):
                try:
                    at = datetime.fromtimestamp(time_s, UTC)
                    p = checked_point(MetricPoint(s.name, step, decode_value(raw), epoch, at,
                                                  s.ranks))  # fmt: skip
                except (ValueError, OverflowError, OSError) as exc:  # OSError: a time out of range
                    refused.append(f"series {k} point {i}: {exc}")
                    continue
                names.append(p.name)
                steps.append(p.step)
                epochs.append(p.epoch)
                values.append(p.value)
                times.append(p.time)
                ranks.append(p.ranks)
    return CheckedColumns(names, steps, epochs, values, times, ranks), refused


_GOOD_NAMES: dict[str, bool] = {}
# How many names ``_name_ok`` remembers (a rank making up names must not grow it for ever).
_MAX_GOOD_NAMES = 10_000


def _name_ok(name: str) -> bool:
    """Whether ``checked_point`` takes ``name`` (a str is immutable: a good one stays good,
    so the answer is remembered)."""
    known = _GOOD_NAMES.get(name)
    if known is not None:
        return known
    try:
        checked_point(MetricPoint(name, 1, 0.0))
        ok = True
    except ValueError:
        ok = False
    if len(_GOOD_NAMES) < _MAX_GOOD_NAMES:
        _GOOD_NAMES[name] = ok
    return ok


def joined(parts: Sequence[CheckedColumns]) -> CheckedColumns:
    """``parts`` one after the other, as one ``CheckedColumns``."""
    if len(parts) == 1:
        return parts[0]
    out = CheckedColumns([], [], [], [], [], [])
    for c in parts:
        out.names.extend(c.names)
        out.steps.extend(c.steps)
        out.epochs.extend(c.epochs)
        out.values.extend(c.values)
        out.times.extend(c.times)
        out.ranks.extend(c.ranks)
    return out
