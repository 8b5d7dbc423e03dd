"""Sorting a sweep's trials table (``service.store.sweeps.table``): any column either way,
missing values last, ties in position order, override values of mixed types."""

from __future__ import annotations

from typing import Any

import pytest

from service.store.sweeps.table import page_of, sort_trials
from service.store.sweeps.values import TrialQuery, TrialView


def trial(position: int, value: float | None, **overrides: Any) -> TrialView:
    return TrialView(
        key=f"k{position}", position=position, overrides=overrides, job_id=position + 1,
        state="running", outcome="running", attempts=1, steps_done=None,
        objective_value=value, run_time_s=None, cancel_requested=False,
    )  # fmt: skip


TRIALS = [
    trial(0, 0.5, lr=0.1),
    trial(1, None, lr="auto"),
    trial(2, 0.2, lr=0.01),
    trial(3, 0.2),
    trial(4, 0.9, lr=[1, 2]),
]


def positions(trials: list[TrialView]) -> list[int]:
    return [t.position for t in trials]


def test_missing_values_last_either_way_and_ties_in_position_order() -> None:
    assert positions(sort_trials(TRIALS, "objective_value", descending=False)) == [2, 3, 0, 4, 1]
    assert positions(sort_trials(TRIALS, "objective_value", descending=True)) == [4, 0, 2, 3, 1]


def test_overrides_of_mixed_types_sort_numbers_then_text_then_the_rest() -> None:
    assert positions(sort_trials(TRIALS, "overrides.lr", descending=False)) == [2, 0, 1, 4, 3]
    assert positions(sort_trials(TRIALS, "overrides.lr", descending=True)) == [4, 1, 0, 2, 3]


def test_a_page_is_cut_after_sorting() -> None:
    query = TrialQuery(sort="objective_value", descending=True, offset=1, limit=2)
    assert positions(page_of(TRIALS, query)) == [0, 2]
    assert positions(page_of(TRIALS, TrialQuery(offset=4))) == [4]
    assert page_of(TRIALS, TrialQuery(offset=9, limit=3)) == []


def test_an_unknown_column_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot sort trials by 'bogus'"):
        sort_trials(TRIALS, "bogus", descending=False)
