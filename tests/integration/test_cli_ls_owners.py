"""`ddpq ls` with two owners against a live server with auth on (SQLite and PostgreSQL): an
admin, who sees everyone's jobs, gets an owner column; an owner, who sees only their own,
does not."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from service.app import create_app
from service.cli.main import app
from service.core.config import Settings
from service.store.db import Database
from tests.live import serve_app

runner = CliRunner()
LONG_OWNER = "bob-" + "b" * 40  # shown whole on a wide terminal, cut with … on 80 columns


@pytest.fixture
def live_auth_url(settings: Settings, db: Database) -> Iterator[str]:
    """The API of ``settings`` with auth on, served by uvicorn on a free loopback port."""
    with serve_app(create_app(settings.model_copy(update={"auth": "on"}))) as url:
        yield url


def token_for(settings: Settings, owner: str, *admin: str) -> str:
    env = {"DDPQ_DATABASE_URL": settings.resolved_database_url, "DDPQ_HOME": str(settings.home)}
    created = runner.invoke(app, ["token", "create", "--owner", owner, *admin], env=env)
    assert created.exit_code == 0, created.output
    return created.stdout.strip()


def ddpq(url: str, token: str, *args: str, columns: int = 200) -> Any:
    env = {"DDPQ_API_URL": url, "DDPQ_TOKEN": token, "COLUMNS": str(columns)}
    result = runner.invoke(app, list(args), env=env)
    assert result.exit_code == 0, result.output
    return result


def header(output: str) -> list[str]:
    return next(line for line in output.splitlines() if line.lstrip().startswith("id ")).split()


def test_ls_shows_owners_only_to_a_caller_who_sees_several(
    live_auth_url: str, settings: Settings, tmp_path: Path
) -> None:
    alice, bob = token_for(settings, "alice"), token_for(settings, LONG_OWNER)
    admin = token_for(settings, "ops", "--admin")
    spec = tmp_path / "job.yaml"
    for token, name in ((alice, "alice-1"), (bob, "bob-1"), (alice, "alice-2")):
        spec.write_text(f"name: {name}\ntask: regression\n")
        ddpq(live_auth_url, token, "submit", str(spec))

    everyone = ddpq(live_auth_url, admin, "ls").stdout
    assert header(everyone)[:4] == ["id", "name", "owner", "state"], everyone
    rows = ((3, "alice-2", "alice"), (2, "bob-1", LONG_OWNER), (1, "alice-1", "alice"))
    for job_id, name, owner in rows:
        assert re.search(rf"^\s*{job_id}\s+{name}\s+{owner}\s+queued\s", everyone, re.M), everyone

    narrow = ddpq(live_auth_url, admin, "ls", columns=80).stdout
    assert all(len(line) <= 80 for line in narrow.splitlines()), narrow
    assert re.search(r"^\s*2\s+\S+\s+bob-b+…\s+queued\s", narrow, re.M), narrow
    assert LONG_OWNER not in narrow, "a long owner is cut to fit 80 columns"

    own = ddpq(live_auth_url, alice, "ls").stdout
    assert header(own)[:3] == ["id", "name", "state"], own
    assert "alice-1" in own and "alice-2" in own and "bob-1" not in own, own
    assert re.search(r"^\s*3\s+alice-2\s+queued\s", own, re.M), own

    # One owner on the page, even for the admin: the column would repeat one name.
    newest_only = ddpq(live_auth_url, admin, "ls", "--limit", "1").stdout
    assert "owner" not in header(newest_only), newest_only
