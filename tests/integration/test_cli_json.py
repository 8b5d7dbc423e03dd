"""The `ddpq` CLI for scripts, against a live uvicorn server on SQLite and PostgreSQL: --json
prints the API's bodies, --csv the metric points, and error messages stay one line each."""

from __future__ import annotations

import csv
import hashlib
import io
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from service.cli.main import app
from service.core import artifacts
from service.core.config import Settings
from service.core.metrics.points import MetricPoint, checked_point
from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.store.checkpoints import crud as checkpoints
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs import crud as jobs
from service.store.metrics import points as metrics
from service.store.workers import registry as workers

SPEC: dict[str, Any] = {"name": "json-job", "task": "regression"}


def ddpq(url: str, *args: str, columns: int = 250) -> Any:
    """Run `ddpq ARGS` against ``url``, its output not a terminal (as under a pipe)."""
    runner = CliRunner()
    return runner.invoke(app, list(args), env={"DDPQ_API_URL": url, "COLUMNS": str(columns)})


def ddpq_json(url: str, *args: str) -> Any:
    """`ddpq ARGS --json`, parsed; fails the test unless it exits 0 with JSON alone."""
    result = ddpq(url, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture
def job_id(live_url: str, db: Database, settings: Settings) -> int:
    """A running job (through the real domain functions) with 3 loss points, a checkpoint at
    step 3 and one registered worker."""
    submitted = httpx.post(f"{live_url}{API_PREFIX}/jobs", json=SPEC, timeout=30)
    assert submitted.status_code == 201, submitted.text
    job_id: int = submitted.json()["id"]
    with db.session() as s:
        workers.register_worker(s, worker_id="w1", host="h", pid=7, launcher="local", capacity={})
    with db.session() as s:
        claims.claim_next_job(s, worker_id="w1", launcher="local", max_gpus_per_node=0, lease_s=30)
        jobs.apply_transition(s, jobs.Transition(job_id, JobState.STARTING, JobState.RUNNING))
        points = [checked_point(MetricPoint("loss", step, 1 / step, 0)) for step in (1, 2, 3)]
        metrics.record_metrics(s, job_id, 1, points)
    path = artifacts.checkpoint_path(settings.resolved_artifact_dir, job_id, 3)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"weights")
    with db.session() as s:
        checkpoints.record_checkpoint(
            s, job_id, 1, step=3, epoch=0, path=str(path), size_bytes=7,
            sha256=hashlib.sha256(b"weights").hexdigest(),
        )  # fmt: skip
    return job_id


def test_json_prints_the_api_bodies(live_url: str, job_id: int) -> None:
    page = ddpq_json(live_url, "ls")
    assert set(page) == {"jobs", "next_cursor"} and [j["id"] for j in page["jobs"]] == [job_id]
    job = ddpq_json(live_url, "show", str(job_id))
    assert job["id"] == job_id and job["state"] == "running" and job["name"] == "json-job"
    assert job == httpx.get(f"{live_url}{API_PREFIX}/jobs/{job_id}").json(), "the API's body as is"
    loss = ddpq_json(live_url, "metrics", str(job_id))
    assert loss["name"] == "loss" and [p["step"] for p in loss["points"]] == [1, 2, 3]
    assert loss["points"][0]["epoch"] == 0, "the API's 0-based epoch"
    events = ddpq_json(live_url, "events", str(job_id))
    assert [e["to_state"] for e in events["events"]] == ["queued", "starting", "running"]
    ckpts = ddpq_json(live_url, "checkpoints", str(job_id))
    assert [(c["step"], c["size_bytes"]) for c in ckpts["checkpoints"]] == [(3, 7)]
    listed = ddpq_json(live_url, "workers")
    assert [(w["id"], w["running_jobs"]) for w in listed["workers"]] == [("w1", [job_id])]


def test_json_escapes_what_a_terminal_would_act_on(live_url: str, db: Database) -> None:
    evil = "red\x1b[31m\u202e[bold]x"
    httpx.post(f"{live_url}{API_PREFIX}/jobs", json={**SPEC, "name": evil}, timeout=30)
    result = ddpq(live_url, "ls", "--json")
    assert result.exit_code == 0 and "\x1b" not in result.stdout and "\u202e" not in result.stdout
    assert json.loads(result.stdout)["jobs"][0]["name"] == evil, "jq gets the name back"


def test_new_commands_print_tables(live_url: str, job_id: int) -> None:
    events = ddpq(live_url, "events", str(job_id))
    assert events.exit_code == 0 and "starting" in events.output and "running" in events.output
    ckpts = ddpq(live_url, "checkpoints", str(job_id))
    assert ckpts.exit_code == 0, ckpts.output
    # One row per checkpoint: its step (3), its size and the store that holds it.
    row = next(line for line in ckpts.output.splitlines() if "7 B" in line)
    assert row.split()[1] == "3" and "filesystem" in row, ckpts.output
    listed = ddpq(live_url, "workers")
    assert listed.exit_code == 0 and "w1" in listed.output and str(job_id) in listed.output


def test_metrics_csv(live_url: str, job_id: int) -> None:
    result = ddpq(live_url, "metrics", str(job_id), "--csv")
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert list(rows[0]) == ["step", "epoch", "value", "time", "name"]
    assert [(r["step"], r["epoch"], r["name"]) for r in rows] == [
        ("1", "0", "loss"), ("2", "0", "loss"), ("3", "0", "loss")
    ]  # fmt: skip
    assert float(rows[2]["value"]) == pytest.approx(1 / 3) and rows[0]["time"].startswith("20")
    both = ddpq(live_url, "metrics", str(job_id), "--csv", "--json")
    assert both.exit_code == 2 and "pass one" in both.output


def test_a_missing_job_points_at_ls(live_url: str, db: Database) -> None:
    for args in (["show", "99999"], ["events", "99999"], ["show", "99999", "--json"]):
        result = ddpq(live_url, *args)
        assert result.exit_code == 2, (args, result.output)
        assert "job 99999 not found" in result.output, result.output
        assert "`ddpq ls`" in result.output, f"{args}: say how to find a job's id"


def test_error_lines_are_not_wrapped_without_a_terminal(
    live_url: str, db: Database, tmp_path: Path
) -> None:
    field = "an_unknown_setting_" + "x" * 90
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({**SPEC, field: 1}))
    result = ddpq(live_url, "submit", str(spec), columns=80)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if field in line]
    assert lines, f"the field's name must stay whole on one line, not cut at 80:\n{result.output}"
    assert lines[0].strip().startswith(f"{field}:"), lines


def test_csv_and_json_export_the_whole_history(live_url: str, job_id: int, db: Database) -> None:
    """More points than one API page: --csv and --json page through all of them (the table
    keeps its 100-point view)."""
    with db.session() as s:
        points = [checked_point(MetricPoint("loss", step, 1 / step, 0)) for step in range(4, 2501)]
        metrics.record_metrics(s, job_id, 1, points)
    rows = list(csv.DictReader(io.StringIO(ddpq(live_url, "metrics", str(job_id), "--csv").stdout)))
    assert [int(r["step"]) for r in rows] == list(range(1, 2501)), "every step, once, in order"
    body = ddpq_json(live_url, "metrics", str(job_id))
    assert len(body["points"]) == 2500 and body["next_after_step"] == 2500
    table = ddpq(live_url, "metrics", str(job_id))
    assert "first 100 points shown" in table.stdout


def test_a_list_setting_that_is_not_json_gets_a_message_not_a_traceback(live_url: str) -> None:
    result = CliRunner().invoke(
        app, ["ls"], env={"DDPQ_API_URL": live_url, "DDPQ_ALLOWED_ENTRYPOINTS": "examples.*:*"}
    )
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "DDPQ_ALLOWED_ENTRYPOINTS is not valid JSON" in result.output
    assert '["examples.*:*"]' in result.output, "the message shows the fix"
