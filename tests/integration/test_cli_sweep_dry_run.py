"""`ddpq sweep submit`: --dry-run validates the sweep file and prints its trials and the first
trial's plan, storing and uploading nothing; and a sweep is validated (every trial) before a
command job's directory is uploaded. Against a live server, SQLite and PostgreSQL."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import func, select
from typer.testing import CliRunner

from service.cli.main import app
from service.store.db import Database
from service.store.models import Job, Sweep, WorkspaceFile
from tests.integration.test_cli_sweeps import SWEEP


def ddpq(url: str, *args: str) -> Any:
    return CliRunner().invoke(app, list(args), env={"DDPQ_API_URL": url, "COLUMNS": "250"})


def stored(db: Database) -> tuple[int, int, int]:
    """How many sweeps, jobs and workspace files the API holds."""
    with db.session(write=False) as s:
        return tuple(  # type: ignore[return-value]
            int(s.scalar(select(func.count()).select_from(t)) or 0)
            for t in (Sweep, Job, WorkspaceFile)
        )


def write(path: Path, sweep: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump(sweep))
    return str(path)


def test_dry_run_prints_the_trials_and_the_first_plan_and_stores_nothing(
    live_url: str, db: Database, tmp_path: Path
) -> None:
    path = write(tmp_path / "sweep.yaml", {**SWEEP, "seeds": 2})
    r = ddpq(live_url, "sweep", "submit", path, "--dry-run")
    assert r.exit_code == 0, r.output
    assert "sweep 'cli-grid': 6 trials; objective loss (min, last value)" in r.output, r.output
    cells = [line.replace("│", " ").split() for line in r.output.splitlines()]
    rows = [c for c in cells if c and c[0].isdigit()]
    assert [row[1:3] for row in rows[:6]] == [
        ["0.001", "0"], ["0.001", "1"], ["0.01", "0"], ["0.01", "1"], ["0.1", "0"], ["0.1", "1"],
    ], r.output  # fmt: skip
    assert "# trial 0 (cli-grid-0)" in r.output and "# plan (local)" in r.output, r.output
    assert "dry run: nothing was stored" in r.output
    answer = json.loads(ddpq(live_url, "sweep", "submit", path, "--dry-run", "--json").stdout)
    assert answer["dry_run"] is True and len(answer["trials"]) == 6
    assert answer["trials"][5]["overrides"] == {"training.lr": 0.1, "training.seed": 1}
    assert answer["first_trial"]["dry_run"] is True
    assert stored(db) == (0, 0, 0), "--dry-run stores nothing"
    r = ddpq(live_url, "sweep", "submit", path, "--dry-run", "--wait")
    assert r.exit_code == 2 and "--wait" in r.output, r.output
    r = ddpq(live_url, "sweep", "submit", path, "--json")  # as `ddpq submit --json`
    assert r.exit_code == 0 and json.loads(r.stdout)["trials_total"] == 6, r.output


def test_dry_run_of_an_invalid_sweep_names_the_trial_and_field(
    live_url: str, db: Database, tmp_path: Path
) -> None:
    bad = write(tmp_path / "bad.yaml", {**SWEEP, "axes": {"training.lr": {"grid": [0.1, -1]}}})
    r = ddpq(live_url, "sweep", "submit", bad, "--dry-run")
    assert r.exit_code == 2, r.output
    assert "the sweep is invalid; nothing was sent" in r.output
    assert "trials.1.training.lr: trial 1" in r.output, r.output
    typo = write(tmp_path / "typo.yaml", {**SWEEP, "sample": 3})
    r = ddpq(live_url, "sweep", "submit", typo, "--dry-run")
    assert r.exit_code == 2 and "sample: " in r.output and "'samples'" in r.output, r.output
    # The deployment's own rules are the API's: checked on the first trial's dry run.
    slurm = write(
        tmp_path / "slurm.yaml", {**SWEEP, "base": {**SWEEP["base"], "launcher": "slurm"}}
    )
    r = ddpq(live_url, "sweep", "submit", slurm, "--dry-run")
    assert r.exit_code == 2, r.output
    assert "trials.0.launcher: trial 0" in r.output and "no Slurm" in r.output, r.output
    assert stored(db) == (0, 0, 0)


def command_sweep(work: Path, axes: dict[str, Any]) -> str:
    """A sweep of a command job whose directory is ``work`` (the sweep file's)."""
    work.mkdir()
    (work / "train.py").write_text("print('hi')\n")
    base = {"name": "c", "command": ["train.py"]}
    return write(work / "sweep.yaml", {"name": "cmd", "base": base, "axes": axes})


def test_a_command_sweep_is_validated_before_its_directory_is_uploaded(
    live_url: str, db: Database, tmp_path: Path
) -> None:
    bad = command_sweep(tmp_path / "bad", {"resources.nproc_per_node": {"grid": [1, 0]}})
    r = ddpq(live_url, "sweep", "submit", bad)
    assert r.exit_code == 2, r.output
    assert "trials.1.resources.nproc_per_node: trial 1" in r.output, r.output
    assert "uploaded" not in r.output and stored(db) == (0, 0, 0), "nothing uploaded"
    good = command_sweep(tmp_path / "good", {"env.LR": {"grid": ["0.1", "0.2"]}})
    r = ddpq(live_url, "sweep", "submit", good, "--dry-run")
    assert r.exit_code == 0, r.output
    assert "would upload 2 files" in r.output and "each rank runs: python train.py" in r.output
    assert stored(db) == (0, 0, 0), "a dry run uploads nothing"
    r = ddpq(live_url, "sweep", "submit", good)
    assert r.exit_code == 0, r.output
    assert "uploaded 2 files" in r.output and "sweep 1 'cmd' running: 2 trials" in r.output
    assert stored(db) == (1, 2, 2), "the script and the sweep file"
