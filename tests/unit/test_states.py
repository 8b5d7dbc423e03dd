"""Every (state, state) pair against the transition table."""

from __future__ import annotations

import itertools

import pytest

from service.core.errors import InvalidTransitionError
from service.core.states import (
    TERMINAL_STATES,
    TRANSITIONS,
    JobState,
    can_transition,
    check_transition,
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
