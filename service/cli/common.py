"""What every `ddpq` command shares: the Typer app, consoles, exit codes and error handling."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import typer
from pydantic import ValidationError
from pydantic_settings import SettingsError
from rich.console import Console
from rich.text import Text

from service.cli.output import field_error_lines, printable
from service.client import ApiError, ApiUnreachableError, DdpqClient
from service.core.config import Settings
from service.core.errors import (
    DatabaseUnavailableError,
    DdpqError,
    JobNotFoundError,
    SchemaOutOfDateError,
    SweepNotFoundError,
)
from service.core.states import TERMINAL_STATES

TERMINAL = frozenset(s.value for s in TERMINAL_STATES)
EXIT_FAILED = 1  # the job failed or was cancelled; or the server refused (409, 5xx)
EXIT_USAGE = 2  # bad input, unreachable API, unmigrated database: fix and retry
# `--json` of the commands that can print the API's response bodies instead of tables.
JSON_OPTION = typer.Option("--json", help="Print the API's response body as JSON (for jq).")

# Help is click's plain layout (rich_markup_mode=None). Typer's rich help panel prints a
# type after every option, flags included (`--wait <bool>`, `--help <bool>`): it calls
# `display_type_rich` for each parameter without the `is_flag` test of the plain formatter
# (seen with typer 0.29). The plain layout shows flags as flags on every typer version.

app = typer.Typer(
    name="ddpq",
    help="Submit and watch distributed PyTorch training jobs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
db_app = typer.Typer(
    help="Database schema migrations (Alembic).",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(db_app, name="db")

# Piped output (a file, grep, a script) is not cut to 80 columns (rich's width for a
# non-terminal): it gets this many, unless COLUMNS says otherwise (``fit_width``).
PIPED_WIDTH = 400
out = Console(highlight=False)
# soft_wrap: a message stays one line however it is read. Without a terminal (a pipe, a log,
# CI) rich would otherwise break every message at 80 columns, mid-URL.
err = Console(stderr=True, highlight=False, soft_wrap=True)


@app.callback()
def fit_width() -> None:
    """Before every command: tables as wide as ``COLUMNS`` when set, else the terminal's, else
    (piped) ``PIPED_WIDTH`` columns."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        out.width = int(columns)
    elif sys.stdout.isatty():
        out.width = shutil.get_terminal_size().columns
    else:
        out.width = PIPED_WIDTH


def fail(message: str, fix: str | None = None, code: int = EXIT_USAGE) -> NoReturn:
    """Print ``message`` (and how to fix it) on stderr and exit with ``code``."""
    # soft_wrap: one line per message, however narrow the terminal (it wraps, we don't).
    error = Text("error: ", style="bold red") + Text(printable(message, keep_newlines=True))
    err.print(error, soft_wrap=True)
    if fix:
        err.print(Text("fix: ", style="bold") + Text(printable(fix)), soft_wrap=True)
    raise typer.Exit(code)


def exit_invalid(subject: str, errors: list[Any]) -> NoReturn:
    """Every problem of an invalid ``subject`` (``"the job"``, ``"the sweep"``) found before
    anything was sent, as the CLI shows an API's 422 (``training.lr: …``); exit 2."""
    err.print(Text(f"error: {subject} is invalid; nothing was sent:", style="bold red"))
    for line in field_error_lines(errors):
        err.print(Text(f"  {line}"))
    raise typer.Exit(EXIT_USAGE)


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
        fail(f"HTTP {exc.status_code}: {exc.detail}", _fix_for(exc), code=code)
    except DatabaseUnavailableError as exc:
        fail(str(exc.detail), "check that the database runs and DDPQ_DATABASE_URL points at it")
    except SchemaOutOfDateError as exc:
        fail(str(exc.detail))
    except DdpqError as exc:
        fail(str(exc.detail), code=EXIT_USAGE if exc.status_code < 500 else EXIT_FAILED)


# How to recover from an API refusal, by the error's stable code (never by its wording).
FIXES: dict[str, str] = {
    JobNotFoundError.code: "list jobs and their ids with `ddpq ls`",
    SweepNotFoundError.code: "list sweeps and their ids with `ddpq sweep ls`",
}


def _fix_for(exc: ApiError) -> str | None:
    """How to recover from an API refusal, where there is a usual way."""
    return FIXES.get(exc.code)


def print_json(body: Any) -> None:
    """Write an API response body to stdout as indented JSON, for scripts and ``jq``.

    Plain ``sys.stdout``, not rich: no markup, colour or wrapping may touch the text. ASCII
    only: control and bidi characters (and lone surrogates) in server data become ``\\u``
    escapes, so they cannot act on a terminal; ``jq`` decodes them back.
    """
    sys.stdout.write(json.dumps(body, indent=2, ensure_ascii=True) + "\n")
    sys.stdout.flush()


def load_settings(**overrides: Any) -> Settings:
    """Settings from the environment (``DDPQ_*``), with non-None ``overrides`` applied."""
    try:
        settings = Settings()
    except SettingsError as exc:
        # pydantic-settings reads list and dict fields as JSON and names only the field.
        match = re.search(r'field "(\w+)"', str(exc))
        name = f"DDPQ_{match[1].upper()}" if match else "a DDPQ_* variable"
        fail(
            f"bad environment: {name} is not valid JSON",
            f"""give it as a JSON list, e.g. {name}='["examples.*:*"]', or unset it""",
        )
    except ValidationError as exc:
        problems = "; ".join(
            # A rule across settings (loc ()) names its settings in its message.
            f"DDPQ_{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}" if e["loc"] else e["msg"]
            for e in exc.errors()
        )
        fail(f"bad environment: {problems}", "fix or unset those DDPQ_* variables")
    updates = {k: v for k, v in overrides.items() if v is not None}
    return settings.model_copy(update=updates) if updates else settings


def make_client(settings: Settings | None = None) -> DdpqClient:
    """A client for ``DDPQ_API_URL`` (default http://127.0.0.1:8000)."""
    settings = settings or load_settings()
    token = settings.token.get_secret_value() if settings.token else ""
    return DdpqClient(settings.resolved_api_url, token=token)
