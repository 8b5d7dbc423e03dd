"""How the CLI shows why a job waits (the Job's ``queue``) and a dry run's answer (``ddpq submit
FILE --dry-run``)."""

from __future__ import annotations

import shlex
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from service.cli.output import cell, printable

MAX_AHEAD_LISTED = 5  # jobs ahead named on the "ahead" line; the count covers the rest


def _ahead_text(queue: dict[str, Any]) -> str:
    parts = []
    for job in queue.get("ahead", [])[:MAX_AHEAD_LISTED]:
        name = f" {job['name']!r}" if job.get("name") is not None else ""
        parts.append(f"job {job['id']}{name} (priority {job['priority']})")
    more = queue.get("ahead_count", 0) - len(parts)
    if more > 0:
        parts.append(f"{more} more")
    return ", ".join(parts)


def _worker_text(worker: dict[str, Any]) -> str:
    if worker.get("can_now"):
        verdict = "can run it now"
    elif worker.get("can_ever"):
        verdict = "could run it, not now: " + "; ".join(worker.get("why_not", []))
    else:
        verdict = "can never run it: " + "; ".join(worker.get("why_not", []))
    notes = "".join(f" (note: {n})" for n in worker.get("notes", []))
    return f"{worker['id']} ({worker['launcher']}): {verdict}{notes}"


def queue_rows(job: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, text) rows of ``ddpq show`` that say why a job waits: the one-line reason, its
    place and the jobs ahead, each worker's verdict, or the scheduler's pending reason. Empty
    for a job that does not wait (or an API without ``queue``)."""
    queue = job.get("queue")
    reason = job.get("queue_reason")
    if not isinstance(queue, dict):
        return [("queued", str(reason))] if job.get("state") == "queued" and reason else []
    if queue.get("scheduler"):
        return [("pending", str(queue["summary"]))]
    rows = [("queued", str(queue["summary"]))]
    if queue.get("position") is not None:
        place = f"{queue['position']} in the queue"
        ahead = _ahead_text(queue)
        rows.append(("position", f"{place}; ahead: {ahead}" if ahead else place))
    rows += [("worker", _worker_text(w)) for w in queue.get("workers", [])]
    return rows


def format_dry_run(answer: dict[str, Any]) -> RenderableType:
    """A dry run's answer for people: each launcher's plan, the resume point, why it would
    wait, the warnings; ends by saying that nothing was stored."""
    parts: list[RenderableType] = []
    for plan in answer.get("plans", []):
        if plan.get("error"):
            parts.append(cell(f"{plan['launcher']}: cannot plan this spec: {plan['error']}"))
        else:
            parts.append(Text(f"# plan ({plan['launcher']})", style="bold"))
            parts.append(Text(printable(plan["text"], keep_newlines=True)))
    command = (answer.get("spec") or {}).get("command")
    if command:  # the plan starts ddpq's rank; what that rank starts is the user's
        shown = shlex.join(["python", *map(str, command)])
        parts.append(cell(f"each rank runs: {shown} (in its attempt's workspace/ directory)"))
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    resume = answer.get("resume")
    if resume:
        grid.add_row("resume", cell(f"job {resume['job_id']} attempt {resume['attempt']}: "
                                    f"{resume['note']}"))  # fmt: skip
    for label, text in queue_rows({"state": "queued", "queue": answer.get("queue")}):
        grid.add_row(label, cell(text))
    for warning in answer.get("warnings", []):
        grid.add_row(Text("warning", style="bold yellow"), cell(warning))
    parts += [grid, Text("dry run: nothing was stored (submit without --dry-run to queue it)")]
    return Group(*parts)
