"""The goodput lines of ``ddpq show``: where the job's wall time went, the work lost to
restarts, and the checkpoint interval estimate (from ``GET /jobs/{id}/goodput``)."""

from __future__ import annotations

from typing import Any

from service.cli.output import format_seconds

# (API field, what people call it), in the order of a job's life.
_PHASES = (
    ("queued_s", "queued"),
    ("starting_s", "starting"),
    ("restore_s", "restore"),
    ("productive_s", "productive"),
    ("checkpoint_stall_s", "checkpoint stall"),
    ("lost_s", "lost"),
    ("in_progress_s", "in progress"),
    ("teardown_s", "teardown"),
)


def _secs(seconds: Any) -> str:
    """Seconds for a ledger line: hundredths under a second, tenths under a minute (short
    phases matter here)."""
    if isinstance(seconds, int | float) and 0 <= seconds < 1:
        return f"{seconds:.2f}s"
    if isinstance(seconds, int | float) and 0 <= seconds < 60:
        return f"{seconds:.1f}s"
    return format_seconds(seconds)


def goodput_rows(ledger: dict[str, Any] | None) -> list[tuple[str, str]]:
    """``(label, text)`` rows for the job report; none before any attempt was claimed."""
    if not ledger or not any(a.get("claimed_at") for a in ledger.get("attempts", [])):
        return []
    rows: list[tuple[str, str]] = []
    share = ledger.get("goodput")
    wall = _secs(ledger["wall_s"])
    if isinstance(share, int | float):
        rows.append(("goodput", f"{share:.0%} of {wall} since submission was productive training"))
    else:
        rows.append(("goodput", f"not measured: no training step reported in {wall} since "
                                "submission (a script reports steps with ddpq.report or "
                                "--tensorboard)"))  # fmt: skip
    spent = [f"{label} {_secs(ledger[key])}" for key, label in _PHASES if ledger.get(key)]
    rows.append(("time", " · ".join(spent)))
    for a in ledger["attempts"]:
        lost = a.get("lost_steps_range")
        if lost:
            first, last = lost
            steps = f"step {first}" if first == last else f"steps {first}-{last}"
            rows.append(
                (
                    f"lost (attempt {a['attempt']})",
                    f"{steps} ({_secs(a['lost_s'])}), trained again by attempt "
                    f"{a['superseded_by']} after it resumed from step {first - 1}",
                )
            )
    estimate = ledger.get("checkpoint_interval")
    if estimate:
        text = f"every ~{_secs(estimate['interval_s'])}"
        if estimate.get("interval_steps"):
            text += f" (~{estimate['interval_steps']} steps"
            now = estimate.get("current_interval_steps")
            text += f"; now every {now})" if now else ")"
        text += (
            f": Young/Daly estimate, sqrt(2 × save cost {_secs(estimate['save_cost_s'])}"
            f" × MTBF {_secs(estimate['mtbf_s'])})"
        )
        rows.append(("ckpt interval", text))
    return rows
