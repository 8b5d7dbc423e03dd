"""`ddpq sweep submit --wait`'s live status line ends its line before the summary, whether
the output is a terminal or a file."""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
from rich.console import Console

from service.cli.sweeps import commands as sweeps


class FakeSweepClient:
    """Answers ``get_sweep`` with each state in turn, the last one terminal."""

    def __init__(self, states: list[str]) -> None:
        self.states = states

    def get_sweep(self, sweep_id: int) -> dict[str, Any]:
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        done = state == "succeeded"
        return {
            "id": sweep_id,
            "name": "digits-lr-tiny",
            "state": state,
            "trials_total": 2,
            "counts": {"succeeded": 2} if done else {"running": 2},
            "objective": {"metric": "loss"},
            "best": None,
        }


@pytest.mark.parametrize("terminal", [False, True], ids=["file", "terminal"])
def test_summary_starts_on_its_own_line(monkeypatch: pytest.MonkeyPatch, terminal: bool) -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=terminal, highlight=False, width=120)
    monkeypatch.setattr(sweeps, "out", console)
    client: Any = FakeSweepClient(["running", "succeeded"])
    assert sweeps.wait_for_sweep(client, 1, poll_s=0.01) == 0
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue())  # colours, cursor moves
    last_status = "sweep 1 succeeded: 2 trials: 2 succeeded"
    summary = "sweep 1 'digits-lr-tiny'"
    assert last_status in text and summary in text, repr(text)
    between = text[text.rindex(last_status) + len(last_status) : text.index(summary)]
    assert between.endswith("\n"), repr(text)
