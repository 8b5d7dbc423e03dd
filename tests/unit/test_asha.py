"""The ASHA decision (pure): rungs, the top 1/reduction_factor rule, arrival order, NaN."""

from __future__ import annotations

import math

from service.core.sweeps.asha import decide_at_rung, rung_step, rungs_up_to


def test_rungs_are_rung_steps_times_powers_of_the_factor() -> None:
    assert [rung_step(100, 3, k) for k in range(3)] == [100, 300, 900]
    assert rungs_up_to(100, 3, 99) == []
    assert rungs_up_to(100, 3, 300) == [0, 1]


def test_first_arrival_goes_on_and_later_ones_need_the_top_third() -> None:
    first = decide_at_rung(0.5, [], rung=0, step=10, mode="min", reduction_factor=3)
    assert not first.stop and first.n == 1
    worse = decide_at_rung(0.9, [0.5], rung=0, step=10, mode="min", reduction_factor=3)
    assert worse.stop and worse.cut == 0.5 and worse.keep == 1
    better = decide_at_rung(0.1, [0.5], rung=0, step=10, mode="min", reduction_factor=3)
    assert not better.stop


def test_nine_trials_keep_three_and_the_message_has_the_numbers() -> None:
    earlier = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    third = decide_at_rung(
        0.3, earlier[:2] + earlier[3:], rung=1, step=400, mode="min", reduction_factor=3
    )
    assert not third.stop and third.keep == 3, "the 3rd best of 9 is still in the top 1/3"
    d = decide_at_rung(0.41, earlier, rung=1, step=400, mode="min", reduction_factor=3)
    assert d.stop and d.cut == 0.3 and d.n == 9
    assert d.message("eval_loss", 3) == (
        "stopped at rung 1, step 400: eval_loss 0.41 not in the top 1/3 (cut 0.3) of 9 trials"
    )


def test_max_mode_and_nan() -> None:
    assert decide_at_rung(0.2, [0.9], rung=0, step=1, mode="max", reduction_factor=2).stop
    assert not decide_at_rung(0.95, [0.9], rung=0, step=1, mode="max", reduction_factor=2).stop
    assert decide_at_rung(math.nan, [], rung=0, step=1, mode="min", reduction_factor=3).stop
    assert not decide_at_rung(0.5, [math.nan], rung=0, step=1, mode="min", reduction_factor=3).stop
