"""Asynchronous successive halving (ASHA): the pure decision, whether a trial that reached a
rung goes on.

Rule (Li et al. 2018, "A System for Massively Parallel Hyperparameter Tuning", MLSys 2020,
in its stopping form as Ray Tune's ``AsyncHyperBandScheduler`` uses it): rung ``k`` sits at
``rung_steps × reduction_factor^k`` steps. When a trial reaches a rung, its objective there
is compared with the values of every trial that reached that rung so far, itself included
(asynchronous: nobody waits for a full rung). With ``n`` values it goes on only if it is
among the best ``ceil(n / reduction_factor)`` of them; the ``cut`` is the value at that rank.
A first arrival always goes on; a NaN never does (it ranks last).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from service.core.events import EventKind, render


def rung_step(rung_steps: int, reduction_factor: int, rung: int) -> int:
    """The step of rung ``rung`` (0-based): ``rung_steps × reduction_factor^rung``."""
    return int(rung_steps * reduction_factor**rung)


def rungs_up_to(rung_steps: int, reduction_factor: int, step: int) -> list[int]:
    """Indices of the rungs at or below ``step`` (those a trial at ``step`` has reached)."""
    rungs: list[int] = []
    while rung_step(rung_steps, reduction_factor, len(rungs)) <= step:
        rungs.append(len(rungs))
    return rungs


@dataclass(frozen=True)
class RungDecision:
    """The verdict for one trial at one rung, with the numbers behind it."""

    stop: bool
    rung: int
    step: int
    value: float
    cut: float
    n: int  # trials that reached the rung, this one included
    keep: int  # how many of them go on: ceil(n / reduction_factor)

    def event_data(self, metric: str, reduction_factor: int) -> dict[str, object]:
        """The data of the ``early_stopped`` job event of a stop (``service.core.events``)."""
        return {
            "rung": self.rung, "step": self.step, "metric": metric, "value": self.value,
            "cut": self.cut, "n": self.n, "reduction_factor": reduction_factor,
        }  # fmt: skip

    def message(self, metric: str, reduction_factor: int) -> str:
        """``stopped at rung 2, step 400: eval_loss 0.41 not in the top 1/3 (cut 0.37) of 9
        trials`` (the ``early_stopped`` event's wording), or the "goes on" wording."""
        if self.stop:
            return str(render(EventKind.EARLY_STOPPED, self.event_data(metric, reduction_factor)))
        return (
            f"continues at rung {self.rung}, step {self.step}: {metric} {self.value:.4g} "
            f"in the top 1/{reduction_factor} (cut {self.cut:.4g}) of {self.n} trials"
        )


def _sort_key(mode: Literal["max", "min"]) -> Callable[[float], tuple[bool, float]]:
    def key(v: float) -> tuple[bool, float]:  # NaN last, then best first
        return (math.isnan(v), -v if mode == "max" else v)

    return key


def decide_at_rung(
    value: float,
    earlier: Sequence[float],
    *,
    rung: int,
    step: int,
    mode: Literal["max", "min"],
    reduction_factor: int,
) -> RungDecision:
    """Whether a trial whose objective at rung ``rung`` (step ``step``) is ``value`` goes on,
    given the ``earlier`` values of the trials that reached the rung before it.

    Returns:
        The decision; ``stop`` is True when ``value`` is worse than the ``cut``, the
        ``ceil(n / reduction_factor)``-th best of the ``n`` values (this one included).
    """
    values = sorted([*earlier, value], key=_sort_key(mode))
    n = len(values)
    keep = max(1, math.ceil(n / reduction_factor))
    cut = values[keep - 1]
    if math.isnan(value):
        stop = True
    elif math.isnan(cut):
        stop = False
    else:
        stop = value < cut if mode == "max" else value > cut
    return RungDecision(stop, rung, step, value, cut, n, keep)
