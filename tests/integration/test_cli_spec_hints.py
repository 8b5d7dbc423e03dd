"""What `ddpq submit`/`ddpq run` say about a spec field that is in the wrong place: a
top-level name that is a nested field's gets its dotted path, and a command job refuses the
training fields only the built-in loop reads (checked before a command job's files are
uploaded). Against a live server, SQLite and PostgreSQL."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from service.cli.main import app
from service.store.db import Database
from service.store.models import WorkspaceFile
from tests.integration.test_dry_run import rows


def ddpq(url: str, *args: str) -> Any:
    return CliRunner().invoke(app, list(args), env={"DDPQ_API_URL": url, "COLUMNS": "300"})


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A command job's directory: one script."""
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "train.py").write_text("print('hi')\n")
    return tmp_path / "work"


def run(url: str, work: Path, *options: str) -> Any:
    return ddpq(url, "run", "--workdir", str(work), "--dry-run", *options, "--", "train.py")


HINT = "timeout_min: Extra inputs are not permitted: did you mean 'resources.timeout_min'?"


def test_a_nested_field_set_at_the_top_gets_its_dotted_path(
    live_url: str, db: Database, tmp_path: Path, work: Path
) -> None:
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"name": "j", "task": "regression"}))
    r = ddpq(live_url, "submit", str(spec), "--set", "timeout_min=5")
    assert r.exit_code == 2 and HINT in r.output, r.output
    r = run(live_url, work, "--set", "timeout_min=5")
    assert r.exit_code == 2 and HINT in r.output, r.output
    r = ddpq(live_url, "submit", str(spec), "--set", "resources.timeout_min=5", "--dry-run")
    assert r.exit_code == 0, r.output
    assert rows(db) == (0, 0, 0)


def test_a_command_job_refuses_training_fields_of_the_builtin_loop(
    live_url: str, db: Database, tmp_path: Path, work: Path
) -> None:
    r = run(live_url, work, "--set", "training.lr=0.1")
    assert r.exit_code == 2, r.output
    assert "training.lr: training.lr applies to the built-in tasks" in r.output, r.output
    assert "never reads it" in r.output
    spec = work / "cmd.json"
    spec.write_text(json.dumps({"name": "c", "command": ["train.py"], "training": {"epochs": 3}}))
    r = ddpq(live_url, "submit", str(spec))
    assert r.exit_code == 2 and "training.epochs applies to the built-in tasks" in r.output
    assert "the job is invalid; nothing was sent" in r.output, "refused before its upload"
    assert rows(db) == (0, 0, 0)
    with db.session(write=False) as s:
        assert s.scalar(select(func.count()).select_from(WorkspaceFile)) == 0, "no file sent"
    # What a command job does use goes through.
    r = run(live_url, work, "--set", "training.seed=3", "--set", "training.keep_checkpoints=5")
    assert r.exit_code == 0, r.output
    assert "nothing was stored" in r.output
