"""One page of a sweep's trials table: sorted by a column (the objective's value, an
override's, …), missing values last, then cut to ``offset``/``limit``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from service.core.sweeps.trials import OVERRIDE_SORT_PREFIX, TRIAL_SORT_FIELDS
from service.store.sweeps.values import TrialQuery, TrialView

_MISSING = object()


def _field(trial: TrialView, sort: str) -> Any:
    """The value of column ``sort`` of ``trial`` (``_MISSING`` when it has none)."""
    if sort.startswith(OVERRIDE_SORT_PREFIX):
        return trial.overrides.get(sort[len(OVERRIDE_SORT_PREFIX) :], _MISSING)
    value = getattr(trial, sort)
    return _MISSING if value is None else value


def _order_key(value: Any) -> tuple[int, Any]:
    """A key that orders values of mixed types: numbers, then text, then anything else (as
    canonical JSON), each in its own natural order."""
    if isinstance(value, bool):
        return (2, json.dumps(value))
    if isinstance(value, int | float):
        return (0, float(value))
    if isinstance(value, str):
        return (1, value)
    return (2, json.dumps(value, sort_keys=True))


def sort_trials(trials: Sequence[TrialView], sort: str, *, descending: bool) -> list[TrialView]:
    """``trials`` ordered by column ``sort`` (a ``TRIAL_SORT_FIELDS`` name or
    ``overrides.<path>``), ascending or ``descending``; trials without a value last either
    way; ties in position order.

    Raises:
        ValueError: ``sort`` is not a column of the table.
    """
    if sort not in TRIAL_SORT_FIELDS and not sort.startswith(OVERRIDE_SORT_PREFIX):
        raise ValueError(f"cannot sort trials by {sort!r}")
    by_position = sorted(trials, key=lambda t: t.position)
    present = [(t, _field(t, sort)) for t in by_position]
    missing = [t for t, v in present if v is _MISSING]
    # Python's sort is stable, also with reverse=True: equal values keep position order.
    ordered = sorted(
        ((t, v) for t, v in present if v is not _MISSING),
        key=lambda tv: _order_key(tv[1]),
        reverse=descending,
    )
    return [t for t, _ in ordered] + missing


def page_of(trials: Sequence[TrialView], query: TrialQuery) -> list[TrialView]:
    """The rows of ``query``'s page: ``trials`` sorted as it says, from ``offset``, at most
    ``limit`` (None: all the rest)."""
    ordered = sort_trials(trials, query.sort, descending=query.descending)
    end = None if query.limit is None else query.offset + query.limit
    return ordered[query.offset : end]
