"""How the `ddpq` CLI renders jobs for people: tables, the live progress bar, summaries."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.progress import BarColumn, Progress, SpinnerColumn, Task, TextColumn
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
# What replaces the spinner once a job has ended.
END_MARKS = {"succeeded": "✓", "failed": "✗", "cancelled": "■"}
# The first item of a 422 ``loc`` says where the field was (body, query...); people don't care.
_LOC_SOURCES = frozenset({"body", "query", "path", "header"})


def printable(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with every character a terminal would act on written as an escape instead:
    ``ESC[31m`` → ``\\x1b[31m``, bidi overrides → ``\\u202e``, lone surrogates → ``\\ud800``
    (newlines and tabs too, unless ``keep_newlines``). Server data (job names, errors, field
    names) goes through here before it reaches a terminal."""
    if text.isprintable():
        return text
    return "".join(
        ch
        if ch.isprintable() or (keep_newlines and ch in "\n\t")
        else ch.encode("unicode_escape", "backslashreplace").decode("ascii")
        for ch in text
    )


def cell(value: Any, style: str = "", **options: Any) -> Text:
    """``value`` as a table cell: ``printable`` text, never read as rich markup."""
    return Text(printable(str(value)), style=style, **options)


def field_error_lines(detail: list[Any]) -> list[str]:
    """A 422 ``detail`` (``[{loc, msg, type}]``) as ``field.path: msg`` lines (``printable``)."""
    lines = []
    for entry in detail:
        if not isinstance(entry, dict):
            lines.append(printable(str(entry)))
            continue
        loc = [str(part) for part in entry.get("loc", [])]
        if loc and loc[0] in _LOC_SOURCES:
            loc = loc[1:]
        lines.append(printable(f"{'.'.join(loc) or '(spec)'}: {entry.get('msg', '')}"))
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


def parse_time(iso: str) -> datetime:
    """An API time (ISO 8601, ``Z`` or an offset; naive taken as UTC) as an aware datetime."""
    parsed = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def format_age(iso: str, now: datetime | None = None) -> str:
    """How long ago ``iso`` was: ``just now``, ``42s ago``, ``3m ago``, ``5h ago``, ``2d ago``."""
    try:
        seconds = ((now or datetime.now(UTC)) - parse_time(iso)).total_seconds()
    except ValueError:
        return short_time(iso)
    if seconds < 5:
        return "just now"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit} ago"
    return f"{int(seconds)}s ago"


def state_text(state: str) -> Text:
    """The state, coloured."""
    return cell(state, STATE_STYLES.get(state, ""))


def epoch_number(record: dict[str, Any]) -> int | None:
    """The epoch as the CLI shows it, counted from 1: the API's ``epoch_number``, or
    ``epoch + 1`` from a server that sends only the 0-based ``epoch``; None when neither."""
    if record.get("epoch_number") is not None:
        return int(record["epoch_number"])
    return int(record["epoch"]) + 1 if record.get("epoch") is not None else None


def progress_line(job: dict[str, Any]) -> str:
    """``step 39/400 · epoch 2 · 123 samples/s · ETA 1m20s`` (``epoch_number``: 1-based;
    ETA while running); empty before the first report."""
    progress = job.get("progress") or {}
    if progress.get("step") is None:
        return ""
    total = progress.get("total_steps")
    parts = [f"step {progress['step']}" + (f"/{total}" if total else "")]
    if (number := epoch_number(progress)) is not None:
        parts.append(f"epoch {number}")
    rate = progress.get("samples_per_s")
    if isinstance(rate, int | float):
        parts.append(f"{rate:.0f} samples/s")
    if progress.get("eta_s") is not None and job.get("state") == "running":
        parts.append(f"ETA {format_seconds(progress['eta_s'])}")
    return " · ".join(parts)


def progress_detail(job: dict[str, Any]) -> str:
    """``step 40/100  loss 0.1234  812 samples/s  ETA 12s`` from a Job's progress; for a
    queued job, why it waits (``queue_reason``)."""
    if job.get("state") == "queued" and job.get("queue_reason"):
        return str(job["queue_reason"])
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


class JobSpinnerColumn(SpinnerColumn):
    """A spinner while the job is live; once it ended, a mark for its end state instead."""

    def render(self, task: Task) -> RenderableType:
        """The mark of ``task.fields["state"]`` when that is an end state, else the spinner."""
        state = task.fields.get("state")
        if state in END_MARKS:
            return Text(END_MARKS[state], style=STATE_STYLES.get(state, ""))
        return super().render(task)


@contextmanager
def job_progress(console: Console) -> Iterator[Callable[[dict[str, Any]], None]]:
    """A live progress bar; yields ``update(job)`` to call with each polled Job. After an
    ended Job, the line shows its state's mark where the spinner was."""
    with Progress(
        JobSpinnerColumn(),
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        TextColumn("{task.fields[detail]}", markup=False),
        console=console,
        transient=False,
    ) as bar:
        task = bar.add_task("waiting", total=None, detail="", state="")

        def update(job: dict[str, Any]) -> None:
            progress = job.get("progress") or {}
            number = epoch_number(progress)
            description = printable(f"job {job['id']} {job['state']}")
            if number is not None:
                description += f"  epoch {number}"
            total = progress.get("total_steps") or None
            bar.update(
                task,
                description=description,
                completed=progress.get("step") or 0,
                total=total,
                detail=printable(progress_detail(job)),
                state=job["state"],
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
    checkpoint_file: str | None = None,
    goodput: dict[str, Any] | None = None,
) -> RenderableType:
    """The job report: state, why it waits, progress, latest metrics, newest checkpoint (its
    download URL and ``checkpoint_file``, where the file is), where its time went
    (``goodput``: the ``GET /jobs/{id}/goodput`` body), links, error."""
    head = Text(f"job {job['id']} {printable(repr(job['name']))} ") + state_text(job["state"])
    head.append(f"{_duration(job)} (attempt {job['attempt']})")
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("owner", cell(job.get("owner") or ""))
    from service.cli.queue_output import queue_rows  # builds on this module's cells

    for label, text in queue_rows(job):  # why it waits: place, jobs ahead, workers, Slurm
        grid.add_row(label, cell(text))
    line = progress_line(job)
    if line:
        grid.add_row("progress", cell(line))
    for name, value in sorted((job.get("latest_metrics") or {}).items()):
        grid.add_row(cell(name), cell(format_metric(name, value)))
    if checkpoint is not None:
        grid.add_row(
            "checkpoint",
            Text(
                printable(
                    f"step {checkpoint['step']}, {format_bytes(checkpoint['size_bytes'])}, "
                    f"sha256 {checkpoint['sha256']}"
                )
                + f"\n{printable(str(checkpoint_url))}"
            ),
        )
        if checkpoint_file:
            grid.add_row("file", cell(checkpoint_file))
    from service.cli.goodput_output import goodput_rows  # builds on this module's cells

    for label, text in goodput_rows(goodput):  # where the wall time went, lost work
        grid.add_row(label, cell(text))
    grid.add_row("dashboard", cell(dashboard_url))
    if job.get("cancel_requested") and job["state"] not in {"succeeded", "failed", "cancelled"}:
        grid.add_row("cancel", "requested")
    if job.get("error"):
        grid.add_row(
            Text("error", style="bold red"), Text(printable(str(job["error"]), keep_newlines=True))
        )
    return Group(head, grid)


def shows_owner(jobs: list[dict[str, Any]]) -> bool:
    """Whether a job table needs an owner column: only when its jobs have more than one owner.

    The list response does not say whether the caller is an admin; a caller who sees only
    their own jobs always gets one owner, and so does an embedded setup where every job is
    ``local``: a column repeating one name would only take width from the job names.
    """
    return len({job.get("owner") for job in jobs}) > 1


def jobs_table(jobs: list[dict[str, Any]], now: datetime | None = None) -> Table:
    """A table of Jobs: id, name, owner (see ``shows_owner``), state, attempt, progress,
    loss, launcher, age.

    Fits 80 columns: only the name and the owner shrink (cut with …); id, state and the
    rest are never cut; times are ages (``3m ago``) measured from ``now`` (default: the
    current time).
    """
    now = now or datetime.now(UTC)
    with_owner = shows_owner(jobs)
    table = Table(
        box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True
    )
    # Rich narrows "wrappable" columns first: the name and the owner are the only ones.
    table.add_column("id", no_wrap=True, justify="right")
    table.add_column("name", min_width=4)
    if with_owner:
        table.add_column("owner", min_width=5)
    table.add_column("state", no_wrap=True)
    for header in ("attempt", "progress", "loss"):
        table.add_column(header, no_wrap=True, justify="right")
    table.add_column("launcher", no_wrap=True)
    table.add_column("age", no_wrap=True, justify="right")
    for job in jobs:
        progress = job.get("progress") or {}
        step, total = progress.get("step"), progress.get("total_steps")
        shown = f"{step}/{total}" if step is not None and total else (str(step) if step else "")
        loss = (job.get("latest_metrics") or {}).get("loss", "")
        if isinstance(loss, int | float) and not isinstance(loss, bool):
            loss = f"{loss:.4g}"
        owner = (
            [cell(job.get("owner") or "", no_wrap=True, overflow="ellipsis")] if with_owner else []
        )
        table.add_row(
            cell(job["id"]),
            cell(job["name"], no_wrap=True, overflow="ellipsis"),
            *owner,
            state_text(job["state"]),
            cell(job["attempt"]),
            cell(shown),
            cell(format_metric("loss", loss) if loss != "" else ""),
            cell(job["launcher"]),
            cell(format_age(job["created_at"], now)),
        )
    if not jobs:
        table.caption = "no jobs"
    return table


def events_table(events: list[dict[str, Any]]) -> Table:
    """A job's events (state changes), oldest first: time, attempt, from, to, reason, worker."""
    table = Table("time", "attempt", "from", "to", "reason", "worker", title="events")
    for e in events:
        table.add_row(
            cell(short_time(e["created_at"])), cell(e["attempt"]), cell(e["from_state"] or ""),
            cell(e["to_state"]), cell(e["reason"] or ""), cell(e["worker_id"] or ""),
        )  # fmt: skip
    return table


def metric_points_csv(name: str, points: list[dict[str, Any]]) -> str:
    """Metric points as CSV with a header: ``step,epoch,value,time,name``.

    Values are the API's: ``epoch`` 0-based (empty when the job gave none), ``value`` a
    number or ``NaN``/``Infinity``/``-Infinity``, ``time`` ISO 8601 UTC. Text is written
    through ``printable``, so no cell can carry a terminal escape.
    """
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["step", "epoch", "value", "time", "name"])
    for p in points:
        value = "NaN" if p["value"] is None else p["value"]
        epoch = "" if p["epoch"] is None else p["epoch"]
        writer.writerow([p["step"], epoch, printable(str(value)), p["time"], printable(name)])
    return buffer.getvalue()
