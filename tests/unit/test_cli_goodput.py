"""`ddpq show`'s goodput lines, rendered from a ledger as ``GET /jobs/{id}/goodput`` answers
(no server; a real rich Console)."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from service.cli.output import format_job_summary

JOB: dict[str, Any] = {
    "id": 3, "name": "reg", "owner": "alice", "state": "succeeded", "attempt": 2,
    "progress": None, "latest_metrics": {}, "error": None, "started_at": None,
    "finished_at": None, "cancel_requested": False, "queue_reason": None,
}  # fmt: skip
PHASES = {
    "queued_s": 1.0, "starting_s": 6.2, "restore_s": 0.3, "productive_s": 40.0,
    "checkpoint_stall_s": 0.5, "lost_s": 7.6, "teardown_s": 20.4,
}  # fmt: skip
LEDGER: dict[str, Any] = {
    **PHASES,
    "wall_s": 76.0,
    "goodput": 40.0 / 76.0,
    "lost_steps": 3,
    "attempts": [
        {
            "attempt": 1,
            "claimed_at": "2026-01-01T00:00:01Z",
            "lost_steps_range": [5, 7],
            "lost_s": 7.6,
            "superseded_by": 2,
        },
        {
            "attempt": 2,
            "claimed_at": "2026-01-01T00:00:40Z",
            "lost_steps_range": None,
            "lost_s": 0.0,
            "superseded_by": None,
        },
    ],
    "checkpoint_interval": {
        "estimate": True,
        "save_cost_s": 0.25,
        "mtbf_s": 35.0,
        "interval_s": 4.18,
        "interval_steps": 2,
        "current_interval_steps": 4,
    },
}


def render(renderable: Any) -> str:
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(renderable)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(text, str)
    return text


def test_show_tells_goodput_where_the_time_went_and_the_lost_steps() -> None:
    text = render(format_job_summary(JOB, None, None, "http://h/jobs/3", goodput=LEDGER))
    lines = [" ".join(line.split()) for line in text.splitlines()]
    assert "goodput 53% of 1m16s since submission was productive training" in lines, text
    assert (
        "time queued 1.0s · starting 6.2s · restore 0.30s · productive 40.0s · checkpoint stall "
        "0.50s · lost 7.6s · teardown 20.4s"
    ) in lines, text
    assert (
        "lost (attempt 1) steps 5-7 (7.6s), trained again by attempt 2 after it resumed from step 4"
    ) in lines, text
    assert (
        "ckpt interval every ~4.2s (~2 steps; now every 4): Young/Daly estimate, sqrt(2 × save "
        "cost 0.25s × MTBF 35.0s)"
    ) in lines, text


def test_a_job_never_claimed_shows_no_goodput_lines() -> None:
    queued = {**LEDGER, "attempts": [{"attempt": 1, "claimed_at": None}]}
    text = render(format_job_summary(JOB, None, None, "http://h/jobs/3", goodput=queued))
    assert "goodput" not in text and "lost" not in text, text
    assert "goodput" not in render(format_job_summary(JOB, None, None, "http://h/jobs/3"))


def test_a_running_job_shows_its_time_since_the_last_step_as_in_progress() -> None:
    running = {**LEDGER, "teardown_s": 0.0, "in_progress_s": 20.4}
    text = render(format_job_summary(JOB, None, None, "http://h/jobs/3", goodput=running))
    lines = [" ".join(line.split()) for line in text.splitlines()]
    assert (
        "time queued 1.0s · starting 6.2s · restore 0.30s · productive 40.0s · checkpoint stall "
        "0.50s · lost 7.6s · in progress 20.4s"
    ) in lines, text


def test_a_job_that_reported_no_step_says_goodput_is_not_measured() -> None:
    # A plain script (no ddpq.report, no --tensorboard): its time is all "starting", and
    # 0% would read as a job that wasted its run.
    silent = {**LEDGER, "goodput": None, "attempts": LEDGER["attempts"][:1]}
    text = render(format_job_summary(JOB, None, None, "http://h/jobs/3", goodput=silent))
    lines = [" ".join(line.split()) for line in text.splitlines()]
    assert any(
        line.startswith("goodput not measured: no training step reported in 1m16s since")
        for line in lines
    ), text
    assert "0%" not in text, text
