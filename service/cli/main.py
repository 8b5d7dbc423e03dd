"""The `ddpq` command: db, serve, worker, up (`worker` imported lazily); job commands: cli_jobs;
token commands: cli_tokens."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer

from service.cli import checkpoints as cli_checkpoints  # noqa: F401 (registers its command)
from service.cli import job_data as cli_job_data  # noqa: F401 (registers its commands)
from service.cli import jobs as cli_jobs
from service.cli import run as cli_run  # noqa: F401 (registers `ddpq run`)
from service.cli import tokens as cli_tokens
from service.cli.common import app, db_app, fail, friendly_errors, load_settings, out
from service.cli.sweeps import commands as cli_sweeps  # noqa: F401 (registers `ddpq sweep`)
from service.core.config import Settings
from service.core.errors import DatabaseUnavailableError, MigrationError
from service.core.launchers import launcher_names

# Importing cli_jobs and cli_tokens registers the job commands (submit, ls, show, …) and
# `ddpq token …` on ``app``.
__all__ = ["app", "cli_jobs", "cli_tokens", "main", "parse_gpus", "server_settings"]


def _launcher_choice(value: str) -> str:
    """``--launcher``: one of the names in ``service.core.launchers.LAUNCHER_TRAITS``."""
    if value not in launcher_names():
        raise typer.BadParameter(f"{value!r}: choose one of {', '.join(launcher_names())}")
    return value


def server_settings(host: str | None, port: int | None) -> Settings:
    """Settings for `serve`/`up`: ``--host``/``--port`` override DDPQ_HOST/DDPQ_PORT, and
    then also the URL printed and probed (a DDPQ_API_URL for another address is dropped)."""
    settings = load_settings(host=host, port=port)
    if host is not None or port is not None:
        settings = settings.model_copy(update={"api_url": None})
    return settings


# ---- database ---------------------------------------------------------------------------


@contextmanager
def _migration_errors(url: str) -> Iterator[None]:
    from service.store.migrate import migration_errors

    try:
        with migration_errors(url):
            yield
    except MigrationError as exc:
        fail(str(exc.detail), exc.hint)


@db_app.command("upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
) -> None:
    """Migrate the database up to REVISION (default: head)."""
    from service.store import migrate
    from service.store.db import Database, redact_url

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
    from service.store import migrate
    from service.store.db import Database, redact_url

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
    from service.store import migrate
    from service.store.db import Database, redact_url

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
    workers: Annotated[
        int, typer.Option(min=1, max=64, help="API processes (uvicorn workers); ~1 per core.")
    ] = 1,
) -> None:
    """Serve the API and the dashboard (uvicorn) once the database is at head."""
    import uvicorn

    from service.app import create_app
    from service.store.db import Database, redact_url
    from service.store.migrate import check_database

    settings = server_settings(host, port)
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
    out.print(auth_note(settings))
    if workers == 1:
        uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info")
        return
    # Each worker process builds its own app from the environment: hand it --host/--port.
    os.environ.update(DDPQ_HOST=settings.host, DDPQ_PORT=str(settings.port))
    uvicorn.run(
        "service.app:create_app",
        factory=True,
        workers=workers,
        host=settings.host,
        port=settings.port,
        log_level="info",
    )


def auth_note(settings: Settings) -> str:
    """One line saying whether the API demands tokens, and how to get one."""
    if settings.auth_enabled:
        return (
            f"auth on (DDPQ_AUTH={settings.auth}, bind {settings.host}): every call but /healthz "
            "needs a token; make one with `ddpq token create --owner NAME`"
        )
    return (
        f"auth off (DDPQ_AUTH={settings.auth}, bind {settings.host}): anyone who can reach the "
        "port can submit and cancel jobs"
    )


def database_note(settings: Settings, *, new: bool) -> str:
    """One line naming the database `ddpq up` serves (password hidden), and, for an embedded
    file it has just created, that it starts empty: ``DDPQ_HOME`` (default ``.ddpq`` in the
    current directory) picks the file, so `ddpq up` in another directory has other jobs."""
    from service.store.db import redact_url

    line = f"database: {redact_url(settings.resolved_database_url)}"
    if new:
        line += (
            " (new, empty: the embedded database lives in DDPQ_HOME, here "
            f"{settings.home}; start `ddpq up` from the directory you used before to see "
            "its jobs)"
        )
    return line


def _embedded_file_missing(settings: Settings) -> bool:
    """Whether the database is the embedded SQLite file and that file does not exist yet."""
    return settings.database_url is None and not (settings.home / "ddpq.db").exists()


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
    launcher: Annotated[
        str,
        typer.Option(
            callback=_launcher_choice,
            help=f"Which jobs to claim: {' | '.join(launcher_names())}.",
        ),
    ] = "local",
    gpus: Annotated[
        str | None, typer.Option(help="GPU indices this worker may use: 0,1 or none.")
    ] = None,
    slots: Annotated[int, typer.Option(min=1, help="Jobs held at once.")] = 1,
    api: Annotated[
        str | None,
        typer.Option(
            help="The API's URL, e.g. http://api-host:8000 (DDPQ_API_URL; default: "
            "http://DDPQ_HOST:DDPQ_PORT, an API on this host)."
        ),
    ] = None,
) -> None:
    """Run a worker: claim queued jobs over the worker API and launch them (torchrun or
    Slurm).

    A worker needs only the API's URL (--api or DDPQ_API_URL: an address its ranks can reach
    too) and a worker token in DDPQ_WORKER_TOKEN (`ddpq token create --worker` where the
    database is reachable). It refuses to start with DDPQ_DATABASE_URL set: only the API
    holds the database's credentials. DDPQ_RANK_USER (root-run local worker): run the ranks
    as that Unix user.
    """
    gpu_list = parse_gpus(gpus)
    settings = load_settings()
    if api is not None:
        settings = settings.model_copy(update={"api_url": api})
    from worker.main import run_worker

    with friendly_errors():
        run_worker(settings, launcher=launcher, gpus=gpu_list, slots=slots)


@app.command()
def up(
    host: Annotated[str | None, typer.Option(help="Bind address (DDPQ_HOST).")] = None,
    port: Annotated[int | None, typer.Option(min=1, max=65535, help="Port (DDPQ_PORT).")] = None,
) -> None:
    """The embedded default in one command: migrate, serve the API and run one local worker
    (which reaches the API over loopback with a worker token minted for it)."""
    settings = server_settings(host, port)
    from worker.up import check_port_free, run_up

    with friendly_errors():
        # Before the token: minting it revokes the one a running `ddpq up` (on this port,
        # say) gave its worker, which would then be refused while this one fails to bind.
        # Before the auth note too: a refusal ("ddpq already runs at …") then stands alone.
        check_port_free(settings.host, settings.port)
        out.print(auth_note(settings))
        new = _embedded_file_missing(settings)
        token = _prepare_up(settings)
        out.print(database_note(settings, new=new), soft_wrap=True)
        run_up(settings, worker_token=token)


# The name of the worker token `ddpq up` mints for its own worker (replacing the last one).
UP_WORKER_TOKEN_NAME = "ddpq-up"


def _prepare_up(settings: Settings) -> str:
    """Migrate the database to head and mint the worker token of `ddpq up`'s own worker
    (revoking the one its last start minted); the token."""
    from service.store import migrate
    from service.store.auth import service as auth
    from service.store.db import Database

    url = settings.resolved_database_url
    with _migration_errors(url):
        db = Database.from_url(url)
        try:
            migrate.upgrade(db.engine)
            return auth.create_worker_token(db, name=UP_WORKER_TOKEN_NAME, replace=True).token
        finally:
            db.dispose()  # no pooled connection is inherited by the children forked next


def main() -> None:
    """Console-script entry point of `ddpq`."""
    app()
