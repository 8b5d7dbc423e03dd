"""The goodput ledger's arithmetic: phases add up to each attempt's wall time whatever the
clocks say, lost work is what a later resume threw away, and the Young/Daly interval."""

from __future__ import annotations

import math

import pytest

from service.core.goodput import (
    PHASES,
    AttemptMoments,
    attempt_phases,
    lost_from_steps,
    young_daly_interval,
)


def test_a_lost_attempt_splits_into_phases_that_add_up() -> None:
    # Queued 10 s, claimed at 10, restore 2 s inside 10 → 15, steps 1-7 over 15 → 50 (step 4
    # done at 30), 3 s of checkpoint stall, lease expiry noticed at 80.
    m = AttemptMoments(
        enqueued_s=0.0, claimed_s=10.0, ended_s=80.0, training_started_s=15.0,
        last_step_s=50.0, resume_step=0, last_step=7, restore_s=2.0, checkpoint_stall_s=3.0,
        lost_from_step=4, lost_from_s=30.0,
    )  # fmt: skip
    p = attempt_phases(m)
    assert (p.queued, p.starting, p.restore) == (10.0, 3.0, 2.0)
    assert (p.lost, p.checkpoint_stall, p.productive, p.teardown) == (20.0, 3.0, 12.0, 30.0)
    assert (p.lost_steps, p.lost_steps_range) == (3, (5, 7))
    assert p.total == 80.0


@pytest.mark.parametrize(
    "moments",
    [
        # a rank clock ahead of the server's: first step "after" the end
        AttemptMoments(0.0, 5.0, 20.0, training_started_s=30.0, last_step_s=40.0, last_step=3),
        # a rank clock behind: first step before the claim, restore longer than the start
        AttemptMoments(
            0.0,
            5.0,
            20.0,
            training_started_s=1.0,
            last_step_s=9.0,
            last_step=3,
            restore_s=50.0,
            checkpoint_stall_s=99.0,
            lost_from_step=1,
            lost_from_s=-5.0,
        ),
        AttemptMoments(0.0, None, 20.0),  # never claimed (still queued, or cancelled)
        AttemptMoments(0.0, 5.0, 20.0),  # claimed, never stepped (failed at start)
        AttemptMoments(
            0.0,
            5.0,
            20.0,
            training_started_s=30.0,
            last_step_s=9.0,
            last_step=3,
            checkpoint_stall_s=4.0,
            running=True,
        ),
    ],
)
def test_phases_never_go_negative_and_always_add_up(moments: AttemptMoments) -> None:
    p = attempt_phases(moments)
    assert all(getattr(p, phase) >= 0 for phase in PHASES), p
    assert p.total == pytest.approx(moments.ended_s - moments.enqueued_s)


def test_a_running_attempts_time_since_its_last_step_is_in_progress_not_teardown() -> None:
    # Claimed at 5, steps over 10 → 30, still running (or hung) at 100: nothing has ended.
    running = AttemptMoments(0.0, 5.0, 100.0, training_started_s=10.0, last_step_s=30.0,
                             last_step=20, running=True)  # fmt: skip
    p = attempt_phases(running)
    assert (p.productive, p.in_progress, p.teardown) == (20.0, 70.0, 0.0)
    assert p.total == 100.0
    ended = attempt_phases(AttemptMoments(0.0, 5.0, 100.0, training_started_s=10.0,
                                          last_step_s=30.0, last_step=20))  # fmt: skip
    assert (ended.in_progress, ended.teardown) == (0.0, 70.0), "once it ended: teardown"


def test_a_resume_before_the_attempts_own_start_loses_all_its_training() -> None:
    m = AttemptMoments(0.0, 1.0, 10.0, training_started_s=2.0, last_step_s=8.0,
                       resume_step=4, last_step=9, lost_from_step=2)  # fmt: skip
    p = attempt_phases(m)
    assert (p.lost, p.productive, p.lost_steps_range) == (6.0, 0.0, (5, 9))


def test_lost_from_steps_is_the_smallest_later_resume_step() -> None:
    assert lost_from_steps([0, 4, None, 2, 8]) == [2, 2, 2, 8, None]
    assert lost_from_steps([0]) == [None]


def test_young_daly_interval_is_sqrt_of_twice_save_cost_times_mtbf() -> None:
    est = young_daly_interval(10.0, 3600.0, step_s=2.0, current_interval_steps=500)
    assert est.interval_s == pytest.approx(math.sqrt(2 * 10 * 3600))
    assert est.interval_steps == round(math.sqrt(72000) / 2) and est.current_interval_steps == 500
    assert young_daly_interval(0.0, 10.0).interval_steps is None
    with pytest.raises(ValueError, match="MTBF"):
        young_daly_interval(1.0, 0.0)
