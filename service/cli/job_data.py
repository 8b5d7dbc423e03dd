"""The `ddpq` commands that list what jobs and workers recorded (events, workers), as tables
or, with --json, as the API's response bodies; registered on the app. `ddpq checkpoints`
(list and download) is in cli.checkpoints and uses ``checkpoints_table`` from here."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from service.cli.common import JSON_OPTION, app, friendly_errors, make_client, out, print_json
from service.cli.output import (
    cell,
    epoch_number,
    events_table,
    format_bytes,
    format_seconds,
    short_time,
)


def checkpoints_table(job_id: int, checkpoints: list[dict[str, Any]]) -> Table:
    """A job's checkpoints, newest step first: step, epoch (``epoch_number``: 1-based; "-"
    for a followed file, whose epoch ddpq cannot know), attempt, size, the sha256's first 12
    hex digits, time, and the store holding it; and the workspace file of each followed
    checkpoint, when there is one."""
    table = Table(
        "step", "epoch", "attempt", "size", "sha256", "created", "store", title=f"job {job_id}"
    )  # fmt: skip
    followed = any(c.get("file_name") for c in checkpoints)
    if followed:
        table.add_column("file")
    for c in checkpoints:
        table.add_row(
            cell(c["step"]), cell("-" if c.get("file_name") else epoch_number(c)),
            cell(c["attempt"]),
            cell(format_bytes(c["size_bytes"])), cell(str(c["sha256"])[:12]),
            cell(short_time(c["created_at"])), cell(c.get("store") or "filesystem"),
            *([cell(c.get("file_name") or "")] if followed else []),
        )  # fmt: skip
    if not checkpoints:
        table.caption = "no checkpoints yet"
    return table


def workers_table(workers: list[dict[str, Any]]) -> Table:
    """Workers: id, host, pid, launcher, status (live; lost: the API no longer hears from
    it; stopped), heartbeat age, the jobs they run, and when they stopped (a stopped worker
    holds no jobs)."""
    table = Table("id", "host", "pid", "launcher", "status", "heartbeat", "jobs", "stopped")
    for w in workers:
        table.add_row(
            cell(w["id"]), cell(w["host"]), cell(w["pid"]), cell(w["launcher"]),
            cell(w.get("status", "")), cell(f"{format_seconds(w['heartbeat_age_s'])} ago"),
            cell(", ".join(map(str, w["running_jobs"]))),
            cell(short_time(w["stopped_at"]) if w["stopped_at"] else ""),
        )  # fmt: skip
    if not workers:
        table.caption = "no workers have registered"
    return table


@app.command()
def events(
    job_id: Annotated[int, typer.Argument(help="Job id.")],
    as_json: Annotated[bool, JSON_OPTION] = False,
) -> None:
    """Print a job's state changes, oldest first. --json: {"events": [...]}."""
    with friendly_errors():
        job_events = make_client().events(job_id)
    if as_json:
        print_json({"events": job_events})
        return
    out.print(events_table(job_events))


@app.command("workers")
def workers_command(as_json: Annotated[bool, JSON_OPTION] = False) -> None:
    """Print every worker with its heartbeat age and the jobs it runs. --json:
    {"workers": [...]}."""
    with friendly_errors():
        listed = make_client().workers()
    if as_json:
        print_json({"workers": listed})
        return
    out.print(workers_table(listed))
