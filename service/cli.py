"""The `ddpq` command (Typer + rich): db, server, jobs, worker (`worker` imported lazily)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table
from rich.text import Text

from service.cli_output import (
    field_error_lines,
    format_job_summary,
    format_metric,
    job_progress,
    jobs_table,
    short_time,
)
from service.client import ApiError, ApiUnreachableError, DdpqClient
from service.config import Settings
from service.errors import DatabaseUnavailableError, DdpqError, SchemaOutOfDateError

TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
EXIT_FAILED = 1  # the job failed or was cancelled; or the server refused (409, 5xx)
EXIT_USAGE = 2  # bad input, unreachable API, unmigrated database: fix and retry

app = typer.Typer(
    name="ddpq",
    help="Submit and watch distributed PyTorch training jobs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Database schema migrations (Alembic).", no_args_is_help=True)
app.add_typer(db_app, name="db")

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


class LauncherChoice(StrEnum):
    """Launchers a worker can run."""

    local = "local"
    slurm = "slurm"


def fail(message: str, fix: str | None = None, code: int = EXIT_USAGE) -> NoReturn:
    """Print ``message`` (and how to fix it) on stderr and exit with ``code``."""
    err.print(Text("error: ", style="bold red") + Text(message))
    if fix:
        err.print(Text("fix: ", style="bold") + Text(fix))
    raise typer.Exit(code)


@contextmanager
def friendly_errors() -> Iterator[None]:
    """Turn expected errors into a one-screen message and an exit code, never a traceback."""
    try:
        yield
    except ApiUnreachableError as exc:
        fail(str(exc.detail))
    except ApiError as exc:
        if exc.status_code == 422 and isinstance(exc.detail, list):
            err.print(Text("error: the API rejected the input (HTTP 422):", style="bold red"))
            for line in field_error_lines(exc.detail):
                err.print(Text(f"  {line}"))
            raise typer.Exit(EXIT_USAGE) from None
        code = EXIT_USAGE if 400 <= exc.status_code < 500 and exc.status_code != 409 else 1
        fail(f"HTTP {exc.status_code}: {exc.detail}", code=code)
    except DatabaseUnavailableError as exc:
        fail(str(exc.detail), "check that the database runs and DDPQ_DATABASE_URL points at it")
    except SchemaOutOfDateError as exc:
        fail(str(exc.detail))
    except DdpqError as exc:
        fail(str(exc.detail), code=EXIT_USAGE if exc.status_code < 500 else EXIT_FAILED)


def load_settings(**overrides: Any) -> Settings:
    """Settings from the environment (``DDPQ_*``), with non-None ``overrides`` applied."""
    try:
        settings = Settings()
    except ValidationError as exc:
        problems = "; ".join(
            f"DDPQ_{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}" for e in exc.errors()
        )
        fail(f"bad environment: {problems}", "fix or unset those DDPQ_* variables")
    updates = {k: v for k, v in overrides.items() if v is not None}
    return settings.model_copy(update=updates) if updates else settings


def make_client() -> DdpqClient:
    """A client for ``DDPQ_API_URL`` (default http://127.0.0.1:8000)."""
    settings = load_settings()
    token = settings.token.get_secret_value() if settings.token else ""
    return DdpqClient(settings.resolved_api_url, token=token)


# ---- database ---------------------------------------------------------------------------


@contextmanager
def _migration_errors(url: str) -> Iterator[None]:
    from alembic.util import CommandError
    from sqlalchemy.exc import SQLAlchemyError

    from service.db import redact_url

    try:
        yield
    except CommandError as exc:
        fail(f"migration failed: {exc}", "list revisions with `ddpq db current`")
    except SQLAlchemyError as exc:
        reason = getattr(exc, "orig", None) or exc
        fail(
            f"database {redact_url(url)}: {type(reason).__name__}: {reason}",
            "check that the database runs and DDPQ_DATABASE_URL points at it",
        )


@db_app.command("upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
) -> None:
    """Migrate the database up to REVISION (default: head)."""
    from service import migrate
    from service.db import Database, redact_url

    url = load_settings().resolved_database_url
    with friendly_errors(), _migration_errors(url):
        db = Database.from_url(url)
        migrate.upgrade(db.engine, revision)
        out.print(f"database {redact_url(url)} at revision {migrate.current_revision(db.engine)}")
        db.dispose()


@db_app.command("downgrade")
def db_downgrade(
    revision: Annotated[str, typer.Argument(help="Target ('base' empties it).")],
) -> None:
    """Migrate the database down to REVISION."""
    from service import migrate
    from service.db import Database, redact_url

    url = load_settings().resolved_database_url
    with friendly_errors(), _migration_errors(url):
        db = Database.from_url(url)
        migrate.downgrade(db.engine, revision)
        current = migrate.current_revision(db.engine) or "base (empty)"
        out.print(f"database {redact_url(url)} at revision {current}")
        db.dispose()


@db_app.command("current")
def db_current() -> None:
    """Show the database's revision and the code's head revision."""
    from service import migrate
    from service.db import Database, redact_url

    url = load_settings().resolved_database_url
    with friendly_errors(), _migration_errors(url):
        db = Database.from_url(url)
        current, head = migrate.current_revision(db.engine), migrate.head_revision()
        db.dispose()
    out.print(f"database {redact_url(url)}")
    out.print(f"  current: {current or 'none (empty)'}\n  head:    {head}")
    if current != head:
        out.print("  behind: run `ddpq db upgrade`")


# ---- server and worker --------------------------------------------------------------------


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address (DDPQ_HOST).")] = None,
    port: Annotated[int | None, typer.Option(min=1, max=65535, help="Port (DDPQ_PORT).")] = None,
) -> None:
    """Serve the API and the dashboard (uvicorn) once the database is at head."""
    import uvicorn

    from service.api.health import check_database
    from service.app import create_app
    from service.db import Database, redact_url

    settings = load_settings(host=host, port=port)
    url = settings.resolved_database_url
    with friendly_errors():
        db = Database.from_url(url)
        try:
            check_database(db)
        except DatabaseUnavailableError as exc:
            fail(
                f"cannot use database {redact_url(url)}: {exc.detail}",
                "check that the database runs and DDPQ_DATABASE_URL points at it",
            )
        finally:
            db.dispose()
    out.print(f"ddpq API and dashboard on {settings.resolved_api_url}")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info")


def parse_gpus(value: str | None) -> list[int] | None:
    """``"0,1"`` → ``[0, 1]``; ``"none"`` → ``[]`` (no GPUs); unset → None (worker decides).

    Raises:
        typer.BadParameter: anything else.
    """
    if value is None:
        return None
    if value.strip().lower() == "none":
        return []
    try:
        gpus = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"{value!r}: use GPU indices like 0,1 or 'none'") from None
    if not gpus or any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise typer.BadParameter(f"{value!r}: use distinct GPU indices like 0,1 or 'none'")
    return gpus


@app.command()
def worker(
    launcher: Annotated[LauncherChoice, typer.Option(help="Which jobs to claim.")] = (
        LauncherChoice.local
    ),
    gpus: Annotated[
        str | None, typer.Option(help="GPU indices this worker may use: 0,1 or none.")
    ] = None,
    slots: Annotated[int, typer.Option(min=1, help="Jobs held at once.")] = 1,
) -> None:
    """Run a worker: claim queued jobs and launch them (torchrun or Slurm)."""
    gpu_list = parse_gpus(gpus)
    settings = load_settings()
    from worker.main import run_worker

    with friendly_errors():
        run_worker(settings, launcher=launcher.value, gpus=gpu_list, slots=slots)


@app.command()
def up() -> None:
    """The embedded default in one command: migrate, serve the API and run one local worker."""
    settings = load_settings()
    from worker.up import run_up

    with friendly_errors():
        run_up(settings)


# ---- jobs ---------------------------------------------------------------------------------


def load_spec_file(path: Path) -> dict[str, Any]:
    """Read a job spec from a YAML or JSON file (exits 2 with the reason when it can't)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        fail(f"spec file {path} not found", "pass the path of a .yaml or .json job spec")
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"cannot read spec file {path}: {exc}")
    try:
        data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        fail(f"spec file {path} is not valid {path.suffix.lstrip('.').upper() or 'YAML'}: {exc}")
    if not isinstance(data, dict):
        fail(f"spec file {path} must hold a mapping (name, task, resources, ...)")
    return data


@app.command()
def submit(
    spec_file: Annotated[Path, typer.Argument(metavar="SPEC", help="Job spec (.yaml or .json).")],
    name: Annotated[str | None, typer.Option(help="Override the spec's name.")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Follow the job until it ends.")] = False,
    idempotency_key: Annotated[
        str | None, typer.Option(help="Retry-safe key: resubmitting returns the same job.")
    ] = None,
    poll_s: Annotated[float, typer.Option(min=0.05, help="Seconds between polls.")] = 1.0,
) -> None:
    """Submit a job; with --wait, show its progress and exit 0 if it succeeds, 1 if not."""
    spec = load_spec_file(spec_file)
    if name is not None:
        spec["name"] = name
    with friendly_errors():
        client = make_client()
        job = client.submit(spec, idempotency_key=idempotency_key)
        url = f"{client.base_url}/jobs/{job['id']}"
        out.print(Text(f"job {job['id']} {job['name']!r} {job['state']}  {url}"))
        if wait:
            raise typer.Exit(wait_for_job(client, job["id"], poll_s))


def wait_for_job(client: DdpqClient, job_id: int, poll_s: float, max_misses: int = 30) -> int:
    """Show a live progress bar until the job ends; print the summary; return the exit code.

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
                update(job)
                if job["state"] in TERMINAL:
                    break
                time.sleep(poll_s)
    except KeyboardInterrupt:
        err.print(f"stopped waiting; job {job_id} keeps running (`ddpq cancel {job_id}` stops it)")
        return 130
    checkpoints = client.checkpoints(job_id)
    newest = checkpoints[0] if checkpoints else None
    ckpt_url = client.checkpoint_url(job_id, newest["step"]) if newest else None
    dashboard = f"{client.base_url}/jobs/{job_id}"
    out.print(format_job_summary(job, newest, ckpt_url, dashboard))
    return 0 if job["state"] == "succeeded" else EXIT_FAILED


@app.command("ls")
def list_command(
    state: Annotated[str | None, typer.Option(help="Only jobs in this state.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="Most jobs to show.")] = 20,
) -> None:
    """List jobs, newest first."""
    with friendly_errors():
        page = make_client().list_jobs(state=state, limit=limit)
    out.print(jobs_table(page["jobs"]))


@app.command()
def show(job_id: Annotated[int, typer.Argument(help="Job id.")]) -> None:
    """Show one job: state, progress, metrics, error, events and checkpoints."""
    with friendly_errors():
        client = make_client()
        job = client.get_job(job_id)
        events = client.events(job_id)
        checkpoints = client.checkpoints(job_id)
    newest = checkpoints[0] if checkpoints else None
    ckpt_url = client.checkpoint_url(job_id, newest["step"]) if newest else None
    out.print(format_job_summary(job, newest, ckpt_url, f"{client.base_url}/jobs/{job_id}"))
    table = Table("time", "attempt", "from", "to", "reason", "worker", title="events")
    for e in events:
        table.add_row(
            short_time(e["created_at"]), str(e["attempt"]), e["from_state"] or "", e["to_state"],
            Text(e["reason"] or ""), Text(e["worker_id"] or ""),
        )  # fmt: skip
    out.print(table)


@app.command()
def cancel(job_id: Annotated[int, typer.Argument(help="Job id.")]) -> None:
    """Cancel a job (queued: at once; running: its worker stops it)."""
    with friendly_errors():
        job = make_client().cancel(job_id)
    if job["state"] == "cancelled":
        out.print(f"job {job_id} cancelled")
    else:
        out.print(f"job {job_id} {job['state']}: cancel requested, its worker will stop it")


@app.command()
def metrics(
    job_id: Annotated[int, typer.Argument(help="Job id.")],
    name: Annotated[str, typer.Option(help="Metric name.")] = "loss",
    limit: Annotated[int, typer.Option(min=1, help="Most points to show.")] = 100,
    after_step: Annotated[int, typer.Option(min=0, help="Only steps after this one.")] = 0,
) -> None:
    """Print a metric's points (step, epoch, value) in step order."""
    with friendly_errors():
        result = make_client().metrics(job_id, name, after_step=after_step, limit=limit)
    table = Table("step", "epoch", "value", title=Text(f"job {job_id} {name}"))
    for p in result["points"]:
        epoch = "" if p["epoch"] is None else str(p["epoch"] + 1)
        table.add_row(str(p["step"]), epoch, format_metric(name, p["value"]))
    out.print(table)
    if not result["points"]:
        out.print(f"no {name!r} points after step {after_step}")


@app.command()
def logs(
    job_id: Annotated[int, typer.Argument(help="Job id.")],
    rank: Annotated[int, typer.Option(min=0, help="Global rank.")] = 0,
    attempt: Annotated[int | None, typer.Option(min=1, help="Default: current.")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing.")] = False,
    poll_s: Annotated[float, typer.Option(min=0.05, help="Seconds between polls.")] = 1.0,
) -> None:
    """Print a rank's log; with --follow, keep printing until the job ends."""
    offset, ended = 0, False
    with friendly_errors():
        client = make_client()
        try:
            while True:
                chunk = client.logs(job_id, rank=rank, attempt=attempt, offset=offset)
                attempt = chunk["attempt"]
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


def main() -> None:
    """Console-script entry point of `ddpq`."""
    app()
