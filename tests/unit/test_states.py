"""Every (state, state) pair against the transition tables: jobs, sweeps, trial outcomes."""

from __future__ import annotations

import itertools

import pytest

from service.core.errors import InvalidTransitionError
from service.core.states import (
    ENDED_SWEEP_STATES,
    SWEEP_TRANSITIONS,
    TERMINAL_STATES,
    TRANSITIONS,
    TRIAL_TRANSITIONS,
    JobState,
    SweepState,
    TrialOutcome,
    can_transition,
    check_sweep_transition,
    check_transition,
    may_be_best,
    trial_outcome,
)

ALLOWED = {
    ("queued", "starting"),
    ("queued", "cancelled"),
    ("starting", "running"),
    ("starting", "queued"),
    ("starting", "succeeded"),
    ("starting", "failed"),
    ("starting", "cancelled"),
    ("running", "queued"),
    ("running", "succeeded"),
    ("running", "failed"),
    ("running", "cancelled"),
}


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(JobState, JobState)))
def test_every_pair_matches_the_table(src: JobState, dst: JobState) -> None:
    expected = (src.value, dst.value) in ALLOWED
    assert can_transition(src, dst) is expected, f"{src}→{dst} should be allowed={expected}"
    if expected:
        check_transition(src, dst)
    else:
        with pytest.raises(InvalidTransitionError, match=f"from {src} to {dst}"):
            check_transition(src, dst)


def test_terminal_states_never_change() -> None:
    assert {s.value for s in TERMINAL_STATES} == {"succeeded", "failed", "cancelled"}
    for state in TERMINAL_STATES:
        assert TRANSITIONS[state] == frozenset()
        assert state.is_terminal


def test_table_covers_every_state() -> None:
    assert set(TRANSITIONS) == set(JobState)


SWEEP_ALLOWED = {
    ("running", "succeeded"),
    ("running", "failed"),
    ("running", "cancelled"),
    ("succeeded", "running"),  # trials added, or failed ones retried
    ("failed", "running"),
}


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(SweepState, SweepState)))
def test_every_sweep_pair_matches_the_table(src: SweepState, dst: SweepState) -> None:
    expected = (src.value, dst.value) in SWEEP_ALLOWED
    assert (dst in SWEEP_TRANSITIONS[src]) is expected, f"{src}→{dst} should be {expected}"
    if expected:
        check_sweep_transition(src, dst)
    else:
        with pytest.raises(InvalidTransitionError, match=f"sweep from {src} to {dst}"):
            check_sweep_transition(src, dst)


def test_only_a_cancelled_sweep_is_final() -> None:
    assert set(SWEEP_TRANSITIONS) == set(SweepState)
    assert {s.value for s in ENDED_SWEEP_STATES} == {"succeeded", "failed", "cancelled"}
    assert all(s.has_ended for s in ENDED_SWEEP_STATES) and not SweepState.RUNNING.has_ended
    assert [s for s in SweepState if not SWEEP_TRANSITIONS[s]] == [SweepState.CANCELLED]


TRIAL_ALLOWED = ALLOWED | {
    ("starting", "stopped_early"),
    ("running", "stopped_early"),
    ("failed", "queued"),  # retried: a new job
}


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(TrialOutcome, TrialOutcome)))
def test_every_trial_outcome_pair_matches_the_table(src: TrialOutcome, dst: TrialOutcome) -> None:
    expected = (src.value, dst.value) in TRIAL_ALLOWED
    assert (dst in TRIAL_TRANSITIONS[src]) is expected, f"{src}→{dst} should be {expected}"


def test_trial_outcomes_are_the_job_states_and_stopped_early() -> None:
    assert set(TRIAL_TRANSITIONS) == set(TrialOutcome)
    assert [o.value for o in TrialOutcome] == [*(s.value for s in JobState), "stopped_early"]
    assert trial_outcome("running", None) is TrialOutcome.RUNNING
    assert trial_outcome("cancelled", "stopped_early") is TrialOutcome.STOPPED_EARLY
    assert trial_outcome("running", "stopped_early") is TrialOutcome.STOPPED_EARLY
    # The stop reached a job that was finishing: it trained to the end and says so.
    assert trial_outcome("succeeded", "stopped_early") is TrialOutcome.SUCCEEDED
    assert trial_outcome(None, None) is TrialOutcome.CANCELLED, "a trial without a job"


@pytest.mark.parametrize("outcome", list(TrialOutcome))
@pytest.mark.parametrize("cancel_requested", [False, True])
def test_which_trials_may_be_best(outcome: TrialOutcome, cancel_requested: bool) -> None:
    expected = outcome in (TrialOutcome.SUCCEEDED, TrialOutcome.STOPPED_EARLY) or (
        outcome is TrialOutcome.RUNNING and not cancel_requested
    )
    assert may_be_best(outcome, cancel_requested=cancel_requested) is expected
