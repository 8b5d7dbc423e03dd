"""The `ddpq sweep` commands: submit (with --wait: live counts by outcome), ls, show (the
trials table, best first), retry, extend, cancel."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.live import Live
from rich.table import Table
from rich.text import Text

from service.cli.common import (
    EXIT_FAILED,
    JSON_OPTION,
    app,
    err,
    fail,
    friendly_errors,
    load_settings,
    make_client,
    out,
    print_json,
)
from service.cli.jobs import load_spec_file
from service.cli.output import cell, format_metric, format_seconds, state_text
from service.cli.sweeps.plan import check_sweep, dry_run_first_trial, format_sweep_plan
from service.cli.workspace_output import pack_spec_workspace, print_missing, upload_and_say
from service.client import ApiUnreachableError, DdpqClient
from service.core.spec.overrides import OverridePathError, parse_assignment
from service.core.states import ENDED_SWEEP_STATES, SweepState, TrialOutcome

sweep_app = typer.Typer(
    help="Sweeps: many trials of one job spec over a grid or random draws.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(sweep_app, name="sweep")

# Counts read best in lifecycle order, the good ends before the bad ones.
COUNT_ORDER = tuple(
    TrialOutcome(o)
    for o in ("queued", "starting", "running", "succeeded", "stopped_early", "failed", "cancelled")
)


def counts_line(sweep: dict[str, Any]) -> str:
    """``8 trials: 2 running, 5 succeeded, 1 failed`` (zero counts left out)."""
    counts = sweep.get("counts") or {}
    parts = [f"{counts[k]} {k.replace('_', ' ')}" for k in COUNT_ORDER if counts.get(k)]
    return f"{sweep.get('trials_total', 0)} trials: " + (", ".join(parts) or "none")


def best_line(sweep: dict[str, Any]) -> str:
    """``best: job 12 eval_accuracy 0.97 (training.lr=0.01, …)``, or that there is none yet."""
    best, metric = sweep.get("best"), (sweep.get("objective") or {}).get("metric", "?")
    if not best:
        return f"best: none yet ({metric})"
    overrides = ", ".join(f"{k}={json.dumps(v)}" for k, v in best["overrides"].items())
    running = ", still running" if best.get("outcome") == TrialOutcome.RUNNING else ""
    return (
        f"best: job {best['job_id']} {metric} {format_metric(metric, best['value'])} "
        f"({overrides}){running}"
    )


def sweep_summary(sweep: dict[str, Any]) -> Table:
    """A few lines about a sweep: state, counts, best trial, why it stopped."""
    grid = Table.grid(padding=(0, 1))
    grid.add_row(cell(f"sweep {sweep['id']} {sweep['name']!r}"), state_text(sweep["state"]))
    grid.add_row(cell(counts_line(sweep)), cell(""))
    grid.add_row(cell(best_line(sweep)), cell(""))
    if sweep.get("stop_reason"):
        grid.add_row(cell(f"stopped: {sweep['stop_reason']}"), cell(""))
    return grid


def best_first(trials: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """Trials with an objective value best first (by ``mode``), those the API says may be
    best (``may_be_best``, the rule of its ``best``) ahead of the failed and cancelled ones, so
    the first row is the sweep's best; then the rest by position."""
    scored = [t for t in trials if t.get("objective_value") is not None]
    rest = [t for t in trials if t.get("objective_value") is None]
    scored.sort(key=lambda t: t["objective_value"], reverse=mode == "max")
    scored.sort(key=lambda t: not t.get("may_be_best", True))  # stable: keeps the value order
    return scored + sorted(rest, key=lambda t: t["position"])


def trials_table(sweep: dict[str, Any], trials: list[dict[str, Any]]) -> Table:
    """The trials table, best first: position, job, outcome, attempts, steps, objective, run
    time, then one column per override path."""
    objective = sweep.get("objective") or {}
    metric = objective.get("metric", "objective")
    paths = sorted({p for t in trials for p in t["overrides"]})
    table = Table(
        "#",
        "job",
        "outcome",
        "attempts",
        "steps",
        metric,
        "run time",
        *paths,
        title=cell(f"sweep {sweep['id']} trials (best first)"),
    )
    for t in best_first(trials, objective.get("mode", "min")):
        value = t.get("objective_value")
        table.add_row(
            cell(t["position"]),
            cell(t.get("job_id") or ""),
            state_text(t["outcome"]),
            cell(t["attempts"]),
            cell("" if t.get("steps_done") is None else t["steps_done"]),
            cell("" if value is None else format_metric(metric, value)),
            cell("" if t.get("run_time_s") is None else format_seconds(t["run_time_s"])),
            *(cell(json.dumps(t["overrides"].get(p, ""))) for p in paths),
        )
    return table


@sweep_app.command("submit")
def submit_command(
    spec_file: Annotated[Path, typer.Argument(metavar="FILE", help="Sweep spec (.yaml/.json).")],
    wait: Annotated[bool, typer.Option("--wait", help="Follow the sweep until it ends.")] = False,
    poll_s: Annotated[float, typer.Option(min=0.05, help="Seconds between polls.")] = 2.0,
    idempotency_key: Annotated[
        str | None, typer.Option(help="Retry-safe key: resubmitting returns the same sweep.")
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Validate and show what would run (the trials, the first trial's launch "
            "plan) without storing or uploading anything.",
        ),
    ] = False,
    as_json: Annotated[bool, JSON_OPTION] = False,
) -> None:
    """Submit a sweep; with --wait, show live counts by outcome and exit 0 if it succeeds.
    The sweep is validated (every trial) before a command job's directory is uploaded;
    --dry-run: store and upload nothing, print the trials and the plan (--json: as JSON)."""
    if dry_run and wait:
        fail("--wait follows a stored sweep: drop it with --dry-run")
    spec = load_spec_file(spec_file)
    console = err if as_json else out  # with --json, stdout is the answer alone
    with friendly_errors():
        settings = load_settings()
        client = make_client(settings)
        packed = None
        if isinstance(spec.get("base"), dict):  # a command job's directory: packed, not sent
            base, packed = pack_spec_workspace(spec["base"], spec_file.parent, console, settings)
            spec = {**spec, "base": base}
        plan = check_sweep(spec, settings)  # exits 2 before any byte is sent
        if dry_run:
            if packed is not None:
                print_missing(console, client, packed)
            answer = dry_run_first_trial(client, plan)
            if as_json:
                print_json(plan.as_json(answer))
            else:
                out.print(format_sweep_plan(plan, answer))
            return
        if packed is not None:
            upload_and_say(console, client, packed)
        sweep = client.submit_sweep(spec, idempotency_key=idempotency_key)
        if as_json:  # as `ddpq submit --json`: the answer alone, no live line after it
            print_json(sweep)
            return
        line = f"sweep {sweep['id']} {sweep['name']!r} {sweep['state']}: {counts_line(sweep)}"
        out.print(cell(line))
        if wait:
            raise typer.Exit(wait_for_sweep(client, sweep["id"], poll_s))


@contextmanager
def _live_line(first: Text) -> Iterator[Live]:
    """A status line on ``out`` that each ``update(..., refresh=True)`` redraws in place, and
    that ends with a newline whatever ``out`` is: rich ends it so on a terminal only, and in a
    file or a pipe (where it writes the last state once, at the end) the next output would
    run on from it."""
    try:
        with Live(first, console=out, auto_refresh=False) as live:
            yield live
    finally:
        if not out.is_terminal:
            out.line()


def wait_for_sweep(client: DdpqClient, sweep_id: int, poll_s: float, max_misses: int = 30) -> int:
    """Show the sweep's counts live until it ends; print the summary; the exit code (0 when
    it succeeded, 1 otherwise, 130 on Ctrl-C).

    Raises:
        ApiUnreachableError: the API stayed unreachable for ``max_misses`` polls in a row.
    """
    misses = 0
    try:
        with _live_line(cell(f"sweep {sweep_id}: waiting")) as live:
            while True:
                try:
                    sweep = client.get_sweep(sweep_id)
                    misses = 0
                except ApiUnreachableError:
                    misses += 1
                    if misses >= max_misses:
                        raise
                    time.sleep(poll_s)
                    continue
                live.update(
                    cell(f"sweep {sweep_id} {sweep['state']}: {counts_line(sweep)}"), refresh=True
                )
                if sweep["state"] in ENDED_SWEEP_STATES:
                    break
                time.sleep(poll_s)
    except KeyboardInterrupt:
        err.print(f"stopped waiting; sweep {sweep_id} goes on (`ddpq sweep cancel {sweep_id}`)")
        return 130
    out.print(sweep_summary(sweep))
    return 0 if sweep["state"] == SweepState.SUCCEEDED else EXIT_FAILED


@sweep_app.command("ls")
def list_command(
    limit: Annotated[int, typer.Option(min=1, help="Most sweeps to show.")] = 20,
    as_json: Annotated[bool, JSON_OPTION] = False,
) -> None:
    """List sweeps, newest first. --json: the page {"sweeps": [...], "next_cursor": ...}."""
    with friendly_errors():
        page = make_client().list_sweeps(limit=limit)
    if as_json:
        print_json(page)
        return
    table = Table("id", "name", "state", "trials", "best")
    for s in page["sweeps"]:
        table.add_row(
            cell(s["id"]),
            cell(s["name"]),
            state_text(s["state"]),
            cell(counts_line(s)),
            cell(best_line(s).removeprefix("best: ")),
        )
    out.print(table)


@sweep_app.command("show")
def show_command(
    sweep_id: Annotated[int, typer.Argument(help="Sweep id.")],
    as_json: Annotated[bool, JSON_OPTION] = False,
) -> None:
    """Show a sweep and its trials table, best first. --json: {"sweep": ..., "trials": [...]}."""
    with friendly_errors():
        client = make_client()
        sweep = client.get_sweep(sweep_id)
        trials = client.sweep_trials(sweep_id)
    if as_json:
        print_json({"sweep": sweep, "trials": trials})
        return
    out.print(sweep_summary(sweep))
    out.print(trials_table(sweep, trials))


@sweep_app.command("retry")
def retry_command(sweep_id: Annotated[int, typer.Argument(help="Sweep id.")]) -> None:
    """Re-run the failed trials (a new job each, same trial key)."""
    with friendly_errors():
        sweep = make_client().retry_failed(sweep_id)
    out.print(
        cell(
            f"sweep {sweep_id}: {sweep['added']} failed trial(s) queued again; {counts_line(sweep)}"
        )
    )


def axis_values(assignment: str) -> tuple[str, list[Any]]:
    """``"training.lr=0.03,0.1"`` → ``("training.lr", [0.03, 0.1])``: the values are one
    YAML flow list without its brackets (``[1, 2],[3]`` is two lists; ``1e-3`` a number).

    Raises:
        OverridePathError: no ``=``, a bad path, or values YAML cannot read.
    """
    path, sep, raw = assignment.partition("=")
    if not sep or not raw.strip():
        raise OverridePathError(assignment, "write PATH=V1,V2, e.g. --axis training.lr=0.03,0.1")
    path, values = parse_assignment(f"{path}=[{raw}]")
    if not isinstance(values, list):  # e.g. "a]" closes the list early
        raise OverridePathError(path, f"values {raw!r} are not a comma-separated list")
    return path, [parse_assignment(f"{path}={v}")[1] if isinstance(v, str) else v for v in values]


def extension_body(
    file: Path | None, axes: list[str], samples: int | None, seeds: int | None
) -> dict[str, Any]:
    """The ``POST /sweeps/{id}/extend`` body: ``file``'s extension (``{axes, samples,
    seeds}``) with ``--axis`` grid values added and ``--samples``/``--seeds`` set; exits 2
    with the fix when it is malformed or empty."""
    body = load_spec_file(file) if file is not None else {}
    grids = dict(body.get("axes") or {})
    for assignment in axes:
        try:
            path, values = axis_values(assignment)
        except OverridePathError as exc:
            fail(
                f"--axis {exc.detail}",
                "write --axis PATH=V1,V2 with PATH an existing grid axis of the sweep, e.g. "
                "--axis training.lr=0.03,0.1",
            )
        old = grids.get(path, {}).get("grid", []) if isinstance(grids.get(path), dict) else []
        grids[path] = {"grid": [*old, *values]}
    if grids:
        body["axes"] = grids
    if samples is not None:
        body["samples"] = samples
    if seeds is not None:
        body["seeds"] = seeds
    if not body:
        fail(
            "nothing to extend the sweep by",
            "give --axis PATH=V1,V2, --samples N (new total), --seeds K (new total), or "
            "--file FILE with {axes, samples, seeds}",
        )
    return body


@sweep_app.command("extend")
def extend_command(
    sweep_id: Annotated[int, typer.Argument(help="Sweep id.")],
    axis: Annotated[
        list[str] | None,
        typer.Option(
            "--axis",
            metavar="PATH=V1,V2",
            help="More grid values for an existing grid axis (repeatable).",
        ),
    ] = None,
    file: Annotated[
        Path | None,
        typer.Option("--file", metavar="FILE", help="The extension as .yaml/.json."),
    ] = None,
    samples: Annotated[
        int | None, typer.Option(min=1, help="New total of draws of the random axes.")
    ] = None,
    seeds: Annotated[int | None, typer.Option(min=1, help="New total of seed replicas.")] = None,
) -> None:
    """Add trials to a sweep: only those whose overrides it does not hold yet are added."""
    body = extension_body(file, axis or [], samples, seeds)
    with friendly_errors():
        sweep = make_client().extend_sweep(sweep_id, body)
    out.print(cell(f"sweep {sweep_id}: {sweep['added']} trial(s) added; {counts_line(sweep)}"))


@sweep_app.command("cancel")
def cancel_command(sweep_id: Annotated[int, typer.Argument(help="Sweep id.")]) -> None:
    """Cancel a sweep: queued trials at once, running ones by their workers."""
    with friendly_errors():
        sweep = make_client().cancel_sweep(sweep_id)
    out.print(cell(f"sweep {sweep_id} cancelled: {counts_line(sweep)}"))
