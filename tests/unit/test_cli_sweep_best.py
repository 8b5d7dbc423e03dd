"""The CLI shows the sweep's best as the API decides it: ``best_first`` puts the trials the
API says may be best ahead of a failed one with a better value, so its first row is the API's
``best``; the summary's counts follow the trial outcomes."""

from __future__ import annotations

from typing import Any

from service.cli.sweeps.commands import COUNT_ORDER, best_first, counts_line
from service.core.states import TrialOutcome


def trial(position: int, value: float | None, outcome: str, may_be_best: bool) -> dict[str, Any]:
    return {
        "position": position,
        "objective_value": value,
        "outcome": outcome,
        "may_be_best": may_be_best,
    }


def test_the_first_row_is_the_best_the_api_would_name() -> None:
    trials = [
        trial(0, 0.01, "failed", False),  # the lowest loss, but it failed
        trial(1, 0.2, "running", True),
        trial(2, 0.4, "succeeded", True),
        trial(3, None, "queued", False),
        trial(4, 0.1, "cancelled", False),
    ]
    assert [t["position"] for t in best_first(trials, "min")] == [1, 2, 0, 4, 3]
    assert [t["position"] for t in best_first(trials, "max")] == [2, 1, 4, 0, 3]


def test_counts_follow_every_outcome() -> None:
    assert set(COUNT_ORDER) == set(TrialOutcome)
    sweep = {"trials_total": 3, "counts": {"running": 1, "stopped_early": 2, "failed": 0}}
    assert counts_line(sweep) == "3 trials: 1 running, 2 stopped early"
