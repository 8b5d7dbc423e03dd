"""The dashboard's scripts cannot import ``service.core.states``; their copies of the state
lists must name exactly the states there, so a new state is added in both or a test fails."""

from __future__ import annotations

import json
import re
from pathlib import Path

from service.core.states import (
    ENDED_SWEEP_STATES,
    TERMINAL_STATES,
    JobState,
    SweepState,
    TrialOutcome,
)

STATIC = Path(__file__).resolve().parents[2] / "service" / "web" / "static"


def js_list(file: str, name: str) -> list[str]:
    match = re.search(rf"const {name} = (\[[^\]]*\]);", (STATIC / file).read_text())
    assert match, f"{file}: const {name} = [...]"
    values: list[str] = json.loads(match[1])
    return values


def test_job_states_in_ddpq_js() -> None:
    assert set(js_list("ddpq.js", "TERMINAL_STATES")) == {s.value for s in TERMINAL_STATES}
    live = {s.value for s in JobState if not s.is_terminal}
    assert set(js_list("ddpq.js", "LIVE_STATES")) == live


def test_sweep_states_and_outcomes_in_sweep_common_js() -> None:
    live = {s.value for s in SweepState if s not in ENDED_SWEEP_STATES}
    assert set(js_list("sweep_common.js", "SWEEP_LIVE")) == live
    assert set(js_list("sweep_common.js", "OUTCOMES")) == {o.value for o in TrialOutcome}
