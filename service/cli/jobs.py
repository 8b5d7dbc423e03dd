"""The `ddpq` job commands (submit, ls, show, cancel, metrics, logs), registered on the app;
events, checkpoints and workers are in cli.job_data."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from service.cli.common import (
    EXIT_FAILED,
    JSON_OPTION,
    TERMINAL,
    app,
    err,
    fail,
    friendly_errors,
    load_settings,
    make_client,
    out,
    print_json,
)
from service.cli.output import (
    cell,
    epoch_number,
    events_table,
    format_job_summary,
    format_metric,
    job_progress,
    jobs_table,
    metric_points_csv,
)
from service.cli.queue_output import format_dry_run
from service.cli.workspace_output import ship_spec_workspace
from service.client import ApiError, ApiUnreachableError, DdpqClient
from service.core.config import Settings
from service.core.limits import METRIC_PAGE_POINTS
from service.core.spec.overrides import OverridePathError, apply_overrides, parse_assignment
from service.core.spec.text import SpecTextError, parse_spec_text

TABLE_POINTS = 100  # points `ddpq metrics` shows in its table unless --limit says otherwise


def load_spec_file(path: Path) -> dict[str, Any]:
    """Read a job spec from a YAML or JSON file (``.json``: JSON only); exits 2 with the
    reason, located by line or field, when it can't (see ``parse_spec_text``)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        fail(f"spec file {path} not found", "pass the path of a .yaml or .json job spec")
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"cannot read spec file {path}: {exc}")
    try:
        return parse_spec_text(text, json_only=path.suffix.lower() == ".json")
    except SpecTextError as exc:
        fail(f"spec file {path}: {exc}")


def with_overrides(spec: dict[str, Any], assignments: list[str]) -> dict[str, Any]:
    """``spec`` with each ``PATH=VALUE`` of ``--set`` applied (``service.core.spec.overrides``);
    exits 2 with the fix for a malformed one. Whether the field exists is the API's call
    (its 422 names the closest valid field)."""
    try:
        overrides = dict(parse_assignment(a) for a in assignments)
        return apply_overrides(spec, overrides)
    except OverridePathError as exc:
        fail(
            f"--set {exc.detail}",
            "write --set PATH=VALUE with PATH the field's dotted path in the spec, e.g. "
            "--set training.lr=0.01 or --set config.hidden=64",
        )


def checkpoint_file(settings: Settings, checkpoint: dict[str, Any] | None) -> str | None:
    """Where a checkpoint's file is, for people: ``<artifact_dir>/jobs/3/…`` when this
    machine's artifact directory holds it (same host or shared file system), else the path
    relative to the server's artifact directory, saying so; None when the API gave no path."""
    relative = (checkpoint or {}).get("path")
    if not isinstance(relative, str) or not relative:
        return None
    local = settings.resolved_artifact_dir / relative
    if local.is_file():
        return str(local)
    return (
        f"{relative} (in the API server's artifact dir; `ddpq checkpoints --download` fetches it)"
    )


def _summary(client: DdpqClient, settings: Settings, job: dict[str, Any]) -> Any:
    """The job report with its newest checkpoint (URL and file)."""
    job_id = job["id"]
    checkpoints = client.checkpoints(job_id)
    newest = checkpoints[0] if checkpoints else None
    ckpt_url = client.checkpoint_url(job_id, newest["step"]) if newest else None
    dashboard = f"{client.base_url}/jobs/{job_id}"
    try:
        goodput = client.goodput(job_id)
    except ApiError:  # an older server: the report goes without it
        goodput = None
    return format_job_summary(
        job,
        newest,
        ckpt_url,
        dashboard,
        checkpoint_file=checkpoint_file(settings, newest),
        goodput=goodput,
    )


@app.command()
def submit(
    spec_file: Annotated[Path, typer.Argument(metavar="SPEC", help="Job spec (.yaml or .json).")],
    name: Annotated[str | None, typer.Option(help="Override the spec's name.")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Follow the job until it ends.")] = False,
    idempotency_key: Annotated[
        str | None, typer.Option(help="Retry-safe key: resubmitting returns the same job.")
    ] = None,
    poll_s: Annotated[float, typer.Option(min=0.05, help="Seconds between polls.")] = 1.0,
    set_values: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            metavar="PATH=VALUE",
            help="Override one field by its dotted path, e.g. --set training.lr=0.01 "
            "--set config.hidden=64 (VALUE read as YAML: numbers, true/false, text). "
            "Repeatable.",
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Validate and show what would run (launch plan, resume point, queue) "
            "without storing anything.",
        ),
    ] = False,
    as_job: Annotated[
        int | None,
        typer.Option("--as-job", min=1, help="With --dry-run: plan it as this job's next attempt."),
    ] = None,
    as_json: Annotated[bool, JSON_OPTION] = False,
) -> None:
    """Submit a job; with --wait, show its progress and exit 0 if it succeeds, 1 if not.
    --set overrides fields by dotted path; --dry-run: store nothing, print the plan (--json:
    the API's answer)."""
    spec = with_overrides(load_spec_file(spec_file), set_values or [])
    if name is not None:
        spec["name"] = name
    if as_job is not None and not dry_run:
        fail("--as-job goes with --dry-run", "add --dry-run to plan a job's next attempt")
    with friendly_errors():
        settings = load_settings()
        client = make_client(settings)
        # A command job's directory ("workspace: ." or none) ships as `ddpq run` ships it.
        spec = ship_spec_workspace(
            spec, spec_file.parent, err if as_json else out, client, settings, upload=not dry_run
        )
        if dry_run:
            answer = client.dry_run(spec, job_id=as_job)
            if as_json:
                print_json(answer)
            else:
                out.print(format_dry_run(answer))
            return
        job = client.submit(spec, idempotency_key=idempotency_key)
        if as_json:
            print_json(job)
            return
        url = f"{client.base_url}/jobs/{job['id']}"
        out.print(cell(f"job {job['id']} {job['name']!r} {job['state']}  {url}"))
        for warning in job.get("warnings") or []:
            err.print(cell(f"warning: {warning}"))
        if wait:
            raise typer.Exit(wait_for_job(client, job["id"], poll_s, settings=settings))


def _get_job_once_more(client: DdpqClient, job: dict[str, Any]) -> dict[str, Any]:
    """The job re-read after it ended (its last progress and metrics), or ``job`` itself
    if the API does not answer now."""
    try:
        return client.get_job(job["id"])
    except ApiUnreachableError:
        return job


def wait_for_job(
    client: DdpqClient,
    job_id: int,
    poll_s: float,
    max_misses: int = 30,
    settings: Settings | None = None,
) -> int:
    """Show a live progress bar until the job ends; print the summary; return the exit code.

    Once the job has ended it is read once more, so the last line shows its final step and
    its end state's mark instead of the spinner.

    Raises:
        ApiUnreachableError: the API stayed unreachable for ``max_misses`` polls in a row.
    """
    misses = 0
    try:
        with job_progress(out) as update:
            while True:
                try:
                    job = client.get_job(job_id)
                    misses = 0
                except ApiUnreachableError:
                    misses += 1
                    if misses >= max_misses:
                        raise
                    time.sleep(poll_s)
                    continue
                if job["state"] in TERMINAL:
                    job = _get_job_once_more(client, job)
                    update(job)
                    break
                update(job)
                time.sleep(poll_s)
    except KeyboardInterrupt:
        err.print(f"stopped waiting; job {job_id} goes on (`ddpq cancel {job_id}` stops it)")
        return 130
    out.print(_summary(client, settings or load_settings(), job))
    return 0 if job["state"] == "succeeded" else EXIT_FAILED


@app.command("ls")
def list_command(
    state: Annotated[str | None, typer.Option(help="Only jobs in this state.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="Most jobs to show.")] = 20,
    as_json: Annotated[bool, JSON_OPTION] = False,
) -> None:
    """List jobs, newest first; with an owner column when they belong to more than one owner
    (an admin token, or auth off with several owners' jobs). --json: the page
    {"jobs": [...], "next_cursor": ...}."""
    with friendly_errors():
        page = make_client().list_jobs(state=state, limit=limit)
    if as_json:
        print_json(page)
        return
    out.print(jobs_table(page["jobs"]))


@app.command()
def show(
    job_id: Annotated[int, typer.Argument(help="Job id.")],
    as_json: Annotated[bool, JSON_OPTION] = False,
) -> None:
    """Show one job: state, why it waits, progress, metrics, error, events and checkpoints.
    --json: the job's body alone (`ddpq events`/`ddpq checkpoints --json` give the rest)."""
    with friendly_errors():
        settings = load_settings()
        client = make_client(settings)
        job = client.get_job(job_id)
        if as_json:
            print_json(job)
            return
        events = client.events(job_id)
        summary = _summary(client, settings, job)
    out.print(summary)
    out.print(events_table(events))


@app.command()
def cancel(job_id: Annotated[int, typer.Argument(help="Job id.")]) -> None:
    """Cancel a job (queued: at once; running: its worker stops it)."""
    with friendly_errors():
        job = make_client().cancel(job_id)
    if job["state"] == "cancelled":
        out.print(f"job {job_id} cancelled")
    else:
        out.print(cell(f"job {job_id} {job['state']}: cancel requested, its worker will stop it"))


@app.command()
def metrics(
    job_id: Annotated[int, typer.Argument(help="Job id.")],
    name: Annotated[str, typer.Option(help="Metric name.")] = "loss",
    limit: Annotated[
        int | None,
        typer.Option(min=1, help="Most points (default: 100 in the table, all with --csv/--json)."),
    ] = None,
    after_step: Annotated[int, typer.Option(min=0, help="Only steps after this one.")] = 0,
    as_json: Annotated[bool, JSON_OPTION] = False,
    as_csv: Annotated[
        bool, typer.Option("--csv", help="Print step,epoch,value,time,name rows (epoch 0-based).")
    ] = False,
) -> None:
    """Print a metric's points (step, epoch, value) in step order; exit 2 naming the job's
    metrics if it has none called NAME. --json: the API's body {"name", "points",
    "next_after_step"}; --csv: one row per point (both as the API gives them, epoch 0-based)."""
    if as_json and as_csv:
        fail("--json and --csv are two formats: pass one")
    with friendly_errors():
        client = make_client()
        if limit is None and (as_json or as_csv):
            result = all_metric_points(client, job_id, name, after_step=after_step)
        else:
            limit = limit or TABLE_POINTS
            result = client.metrics(job_id, name, after_step=after_step, limit=limit)
        names = client.metric_names(job_id) if not result["points"] else [name]
    if name not in names:
        reports = f"it reports: {', '.join(names)}" if names else "it has reported none yet"
        fail(f"job {job_id} has no metric {name!r}; {reports}")
    if as_json:
        print_json(result)
        return
    if as_csv:
        sys.stdout.write(metric_points_csv(name, result["points"]))
        return
    table = Table("step", "epoch", "value", title=cell(f"job {job_id} {name}"))
    for p in result["points"]:
        number = epoch_number(p)  # points carry the 0-based epoch only
        epoch = "" if number is None else str(number)
        table.add_row(cell(p["step"]), cell(epoch), cell(format_metric(name, p["value"])))
    out.print(table)
    if not result["points"]:
        out.print(cell(f"no {name!r} points after step {after_step}"))
    elif limit is not None and len(result["points"]) >= limit:
        last = result["points"][-1]["step"]
        out.print(cell(f"first {limit} points shown; more with --after-step {last}"))


def all_metric_points(
    client: DdpqClient, job_id: int, name: str, *, after_step: int = 0
) -> dict[str, Any]:
    """Every point of ``name`` after ``after_step``, paged through the API
    (``next_after_step``): ``{"name", "points", "next_after_step"}`` as one body."""
    points: list[dict[str, Any]] = []
    while True:
        page = client.metrics(job_id, name, after_step=after_step, limit=METRIC_PAGE_POINTS)
        points.extend(page["points"])
        if not page["points"] or page["next_after_step"] <= after_step:
            return {"name": name, "points": points, "next_after_step": after_step}
        after_step = page["next_after_step"]


@app.command()
def logs(
    job_id: Annotated[int, typer.Argument(help="Job id.")],
    rank: Annotated[int, typer.Option(min=0, help="Global rank.")] = 0,
    attempt: Annotated[int | None, typer.Option(min=1, help="Default: current.")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing.")] = False,
    poll_s: Annotated[float, typer.Option(min=0.05, help="Seconds between polls.")] = 1.0,
) -> None:
    """Print a rank's log; with --follow, keep printing until the job ends. A rank the job
    does not have exits 2 naming its ranks."""
    offset, ended, found = 0, False, True
    with friendly_errors():
        client = make_client()
        try:
            while True:
                chunk = client.logs(job_id, rank=rank, attempt=attempt, offset=offset)
                attempt = chunk["attempt"]
                found = chunk.get("found", True)  # an older API does not say
                sys.stdout.write(chunk["text"])
                sys.stdout.flush()
                offset = chunk["next_offset"]
                if not chunk["eof"]:
                    continue
                if not follow or ended:
                    break
                # Once the job has ended, one more pass picks up its last lines.
                ended = client.get_job(job_id)["state"] in TERMINAL
                if not ended:
                    time.sleep(poll_s)
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
    if offset == 0:  # on stderr: a script reading stdout still gets the (empty) log
        with friendly_errors():
            job = client.get_job(job_id) if not found else None
        if job is not None and job.get("started_at") and job.get("attempt") == attempt:
            err.print(
                f"no log of rank {rank} of job {job_id} attempt {attempt} on the API's host: "
                "a rank's log stays in the artifact dir of the worker that ran it "
                f"({job.get('worker_id') or 'see `ddpq events`'}) unless that dir is shared "
                "with the API"
            )
        else:
            err.print(f"rank {rank} of job {job_id} logged nothing in attempt {attempt} (yet)")
