"""How the `ddpq` CLI renders jobs for people: tables, the live progress bar, summaries."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn
from rich.table import Table
from rich.text import Text

STATE_STYLES = {
    "queued": "cyan",
    "starting": "yellow",
    "running": "blue",
    "succeeded": "green",
    "failed": "red",
    "cancelled": "magenta",
}
# The first item of a 422 ``loc`` says where the field was (body, query...); people don't care.
_LOC_SOURCES = frozenset({"body", "query", "path", "header"})


def field_error_lines(detail: list[Any]) -> list[str]:
    """A 422 ``detail`` (``[{loc, msg, type}]``) as ``field.path: msg`` lines."""
    lines = []
    for entry in detail:
        if not isinstance(entry, dict):
            lines.append(str(entry))
            continue
        loc = [str(part) for part in entry.get("loc", [])]
        if loc and loc[0] in _LOC_SOURCES:
            loc = loc[1:]
        lines.append(f"{'.'.join(loc) or '(spec)'}: {entry.get('msg', '')}")
    return lines


def format_metric(name: str, value: Any) -> str:
    """A metric value for people: NaN for null, 6 significant digits, accuracies also in %."""
    if value is None:
        return "NaN"
    if isinstance(value, str):
        return value
    v = float(value)
    if "acc" in name.lower() and 0.0 <= v <= 1.0:
        return f"{v:.4f} ({v:.2%})"
    return f"{v:.6g}"


def format_bytes(size_bytes: int) -> str:
    """``1536`` → ``1.5 KiB``."""
    size = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size_bytes} B"  # pragma: no cover - loop always returns


def format_seconds(seconds: Any) -> str:
    """``75.2`` → ``1m15s``; unknown (None, a string) → ``?``."""
    if not isinstance(seconds, int | float) or seconds < 0:
        return "?"
    s = round(seconds)
    hours, rest = divmod(s, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def short_time(iso: str) -> str:
    """``2026-01-02T03:04:05.678Z`` → ``2026-01-02 03:04:05`` (UTC)."""
    return iso[:19].replace("T", " ")


def state_text(state: str) -> Text:
    """The state, coloured."""
    return Text(state, style=STATE_STYLES.get(state, ""))


def progress_detail(job: dict[str, Any]) -> str:
    """``step 40/100  loss 0.1234  812 samples/s  ETA 12s`` from a Job's progress."""
    progress = job.get("progress") or {}
    parts = []
    if progress.get("step") is not None:
        total = progress.get("total_steps")
        parts.append(f"step {progress['step']}" + (f"/{total}" if total else ""))
    if "loss" in (job.get("latest_metrics") or {}):
        parts.append(f"loss {format_metric('loss', job['latest_metrics']['loss'])}")
    rate = progress.get("samples_per_s")
    if isinstance(rate, int | float):
        parts.append(f"{rate:.0f} samples/s")
    if progress.get("eta_s") is not None and job.get("state") == "running":
        parts.append(f"ETA {format_seconds(progress['eta_s'])}")
    return "  ".join(parts)


@contextmanager
def job_progress(console: Console) -> Iterator[Callable[[dict[str, Any]], None]]:
    """A live progress bar; yields ``update(job)`` to call with each polled Job."""
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        TextColumn("{task.fields[detail]}", markup=False),
        console=console,
        transient=False,
    ) as bar:
        task = bar.add_task("waiting", total=None, detail="")

        def update(job: dict[str, Any]) -> None:
            progress = job.get("progress") or {}
            epoch = progress.get("epoch")
            description = f"job {job['id']} {job['state']}"
            if epoch is not None:
                description += f"  epoch {int(epoch) + 1}"
            total = progress.get("total_steps") or None
            bar.update(
                task,
                description=description,
                completed=progress.get("step") or 0,
                total=total,
                detail=progress_detail(job),
            )

        yield update


def _duration(job: dict[str, Any]) -> str:
    start, end = job.get("started_at"), job.get("finished_at")
    if not start or not end:
        return ""
    seconds = (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
    return f" in {format_seconds(seconds)}"


def format_job_summary(
    job: dict[str, Any],
    checkpoint: dict[str, Any] | None,
    checkpoint_url: str | None,
    dashboard_url: str,
) -> RenderableType:
    """The end-of-job report: state, latest metrics, newest checkpoint, links, error."""
    head = Text(f"job {job['id']} {job['name']!r} ") + state_text(job["state"])
    head.append(f"{_duration(job)} (attempt {job['attempt']})")
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    progress = job.get("progress") or {}
    if progress.get("step") is not None:
        epoch = progress.get("epoch")
        grid.add_row(
            "step",
            f"{progress['step']}" + (f" (epoch {int(epoch) + 1})" if epoch is not None else ""),
        )
    for name, value in sorted((job.get("latest_metrics") or {}).items()):
        grid.add_row(Text(name), format_metric(name, value))
    if checkpoint is not None:
        grid.add_row(
            "checkpoint",
            Text(
                f"step {checkpoint['step']}, {format_bytes(checkpoint['size_bytes'])}, "
                f"sha256 {checkpoint['sha256']}\n{checkpoint_url}"
            ),
        )
    grid.add_row("dashboard", Text(dashboard_url))
    if job.get("cancel_requested") and job["state"] not in {"succeeded", "failed", "cancelled"}:
        grid.add_row("cancel", "requested")
    if job.get("error"):
        grid.add_row(Text("error", style="bold red"), Text(job["error"]))
    return Group(head, grid)


def jobs_table(jobs: list[dict[str, Any]]) -> Table:
    """A table of Jobs: id, name, state, attempt, progress, loss, launcher, created."""
    table = Table("id", "name", "state", "attempt", "progress", "loss", "launcher", "created")
    for job in jobs:
        progress = job.get("progress") or {}
        step, total = progress.get("step"), progress.get("total_steps")
        shown = f"{step}/{total}" if step is not None and total else (str(step) if step else "")
        loss = (job.get("latest_metrics") or {}).get("loss", "")
        table.add_row(
            str(job["id"]),
            Text(job["name"]),
            state_text(job["state"]),
            str(job["attempt"]),
            shown,
            format_metric("loss", loss) if loss != "" else "",
            job["launcher"],
            short_time(job["created_at"]),
        )
    if not jobs:
        table.caption = "no jobs"
    return table
