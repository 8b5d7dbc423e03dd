"""`ddpq submit FILE --dry-run` and `ddpq show`'s queue lines, against a live uvicorn server on
SQLite and PostgreSQL: the plan printed is the golden one (the API's, rendered by the
launcher), nothing is stored, and a waiting job says where it is and which workers could take
it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from service.app import create_app
from service.cli.main import app
from service.core.config import Settings
from service.core.wire import API_PREFIX
from service.store.db import Database
from service.store.workers import registry as workers
from tests.integration.test_dry_run import GOLDEN, normalise, rows
from tests.live import serve_app


@pytest.fixture
def live_url(settings: Settings, db: Database) -> Iterator[str]:
    dev = settings.model_copy(update={"slurm_enabled": True, "api_url": "http://api.example:8000"})
    with serve_app(create_app(dev)) as url:
        yield url


def ddpq(url: str, *args: str) -> Any:
    env = {"DDPQ_API_URL": url, "COLUMNS": "1000"}
    return CliRunner().invoke(app, list(args), env=env)


def spec_file(tmp_path: Path, **changes: Any) -> str:
    spec = {"name": "dry", "task": "regression", "resources": {"nproc_per_node": 2},
            "training": {"max_steps": 10}, **changes}  # fmt: skip
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return str(path)


@pytest.mark.parametrize(
    ("golden", "changes"),
    [
        ("dry_run_local.txt", {}),
        (
            "dry_run_slurm.txt",
            {
                "launcher": "slurm",
                "resources": {"nnodes": 2, "nproc_per_node": 2, "timeout_min": 5},
                "slurm": {"partition": "debug"},
            },
        ),
    ],
)
def test_dry_run_prints_the_plan_and_stores_nothing(
    live_url: str, db: Database, tmp_path: Path, golden: str, changes: dict[str, Any]
) -> None:
    before = rows(db)
    result = ddpq(live_url, "submit", spec_file(tmp_path, **changes), "--dry-run")
    assert result.exit_code == 0, result.output
    assert rows(db) == before, "--dry-run stores nothing"
    printed = normalise(result.stdout, tmp_path)
    plan = (GOLDEN / golden).read_text().rstrip("\n")
    assert plan in printed, f"expected the plan of {golden} in:\n{printed}"
    assert "nothing was stored" in printed and "no live worker" in printed
    as_json = ddpq(live_url, "submit", spec_file(tmp_path, **changes), "--dry-run", "--json")
    assert json.loads(as_json.stdout)["dry_run"] is True
    assert rows(db) == before


def test_as_job_needs_dry_run(live_url: str, tmp_path: Path) -> None:
    result = ddpq(live_url, "submit", spec_file(tmp_path), "--as-job", "1")
    assert result.exit_code == 2 and "--dry-run" in result.output


def test_show_says_where_a_job_waits_and_submit_warns(
    live_url: str, db: Database, tmp_path: Path
) -> None:
    with db.session() as s:
        workers.register_worker(s, worker_id="cpu-box", host="h", pid=1, launcher="local",
                                capacity={"slots": 1, "gpus": []})  # fmt: skip
    first = httpx.post(f"{live_url}{API_PREFIX}/jobs", timeout=30,
                       json={"name": "first", "task": "regression", "priority": 3})  # fmt: skip
    assert first.status_code == 201, first.text
    submitted = ddpq(live_url, "submit", spec_file(tmp_path))
    assert submitted.exit_code == 0, submitted.output
    job_id = int(submitted.stdout.split()[1])
    shown = ddpq(live_url, "show", str(job_id))
    assert shown.exit_code == 0, shown.output
    assert "waiting for a worker to claim it (1 queued job ahead)" in shown.stdout
    assert f"2 in the queue; ahead: job {first.json()['id']} 'first' (priority 3)" in shown.stdout
    assert "cpu-box (local): can run it now" in shown.stdout
    gpu = ddpq(live_url, "submit", spec_file(tmp_path, resources={"nproc_per_node": 1,
                                                                  "gpus_per_node": 1}))  # fmt: skip
    assert gpu.exit_code == 0, gpu.output
    assert "warning: no registered local worker could ever run this job" in gpu.stderr
