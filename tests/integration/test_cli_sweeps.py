"""`ddpq sweep …` and `ddpq submit --set` against a live server (real HTTP), SQLite and
PostgreSQL."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import select
from typer.testing import CliRunner

from service.cli.main import app
from service.core.states import JobState
from service.store.db import Database
from service.store.jobs import crud as jobs
from service.store.models import Job
from service.store.reaper import reap_once

runner = CliRunner()
SWEEP: dict[str, Any] = {
    "name": "cli-grid",
    "base": {"name": "b", "task": "regression", "training": {"max_steps": 5}},
    "axes": {"training.lr": {"grid": [0.001, 0.01, 0.1]}},
}


def ddpq(url: str, *args: str) -> Any:
    return runner.invoke(app, list(args), env={"DDPQ_API_URL": url, "COLUMNS": "250"})


def finish(db: Database, job_id: int, end: JobState, loss: float) -> None:
    with db.session() as s:
        for a, b in [(JobState.QUEUED, JobState.STARTING), (JobState.STARTING, JobState.RUNNING)]:
            jobs.apply_transition(s, jobs.Transition(job_id, a, b))
        job = s.get(Job, job_id)
        assert job is not None
        job.latest_metrics = {"loss": {"value": loss, "step": 5}}
        jobs.apply_transition(s, jobs.Transition(job_id, JobState.RUNNING, end))


def test_sweep_submit_show_retry_cancel(live_url: str, db: Database, tmp_path: Path) -> None:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(SWEEP))
    r = ddpq(live_url, "sweep", "submit", str(path))
    assert r.exit_code == 0, r.output
    assert "sweep 1 'cli-grid' running: 3 trials: 3 queued" in r.output
    trials = json.loads(ddpq(live_url, "sweep", "show", "1", "--json").output)["trials"]
    for t, (end, loss) in zip(
        trials,
        [(JobState.SUCCEEDED, 0.5), (JobState.SUCCEEDED, 0.2), (JobState.FAILED, 9.0)],
        strict=True,
    ):
        finish(db, t["job_id"], end, loss)
    shown = ddpq(live_url, "sweep", "show", "1")
    assert shown.exit_code == 0, shown.output
    assert "best: job 2 loss 0.2" in shown.output
    rows = [line for line in shown.output.splitlines() if "succeeded" in line or "failed" in line]
    assert [line.split()[1] for line in rows[-3:]] == ["1", "0", "2"], "best first (by position)"
    r = ddpq(live_url, "sweep", "retry", "1")
    assert r.exit_code == 0 and "1 failed trial(s) queued again" in r.output, r.output
    assert "cli-grid" in ddpq(live_url, "sweep", "ls").output
    r = ddpq(live_url, "sweep", "cancel", "1")
    assert r.exit_code == 0 and "sweep 1 cancelled" in r.output, r.output
    r = ddpq(live_url, "sweep", "show", "99")
    assert r.exit_code == 2 and "sweep 99 not found" in r.output


def test_sweep_submit_wait_ends_with_the_summary(
    live_url: str, db: Database, tmp_path: Path
) -> None:
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({**SWEEP, "axes": {"training.lr": {"grid": [0.01]}}}))

    def run_the_trial() -> None:  # plays the worker (and the reaper) once the sweep exists
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with db.session(write=False) as s:
                job = s.scalar(select(Job.id).where(Job.sweep_id.is_not(None)))
            if job is not None:
                finish(db, job, JobState.SUCCEEDED, 0.3)
                reap_once(db)
                return
            time.sleep(0.05)

    helper = threading.Thread(target=run_the_trial)
    helper.start()
    r = ddpq(live_url, "sweep", "submit", str(path), "--wait", "--poll-s", "0.1")
    helper.join()
    assert r.exit_code == 0, r.output
    assert "1 trials: 1 succeeded" in r.output and "best: job 1 loss 0.3" in r.output
    # Not a terminal: the live status line's last state, then the summary on a line of its own.
    lines = r.output.splitlines()
    assert lines[-4] == "sweep 1 succeeded: 1 trials: 1 succeeded", r.output
    assert lines[-3].startswith("sweep 1 'cli-grid'") and "succeeded" in lines[-3], r.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**SWEEP, "axes": {"training.lr": {"grid": [-1]}}}))
    r = ddpq(live_url, "sweep", "submit", str(bad))
    assert r.exit_code == 2
    assert "trials.0.training.lr: trial 0" in r.output, r.output


def test_submit_set_overrides_fields_and_explains_bad_ones(
    live_url: str, db: Database, tmp_path: Path
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(SWEEP["base"]))
    r = ddpq(
        live_url, "submit", str(path), "--set", "training.lr=1e-2", "--set", "config.hidden=64"
    )
    assert r.exit_code == 0, r.output
    with db.session(write=False) as s:
        job = s.get(Job, 1)
        assert job is not None
        assert job.spec["training"]["lr"] == 0.01 and job.spec["config"]["hidden"] == 64
    r = ddpq(live_url, "submit", str(path), "--set", "training.lr")
    assert r.exit_code == 2 and "fix: write --set PATH=VALUE" in r.output, r.output
    r = ddpq(live_url, "submit", str(path), "--set", "name.x=1")
    assert r.exit_code == 2 and "not an object" in r.output, r.output
    r = ddpq(live_url, "submit", str(path), "--set", "training.lrr=0.1")
    assert r.exit_code == 2 and "training.lrr" in r.output and "did you mean 'lr'" in r.output


def test_sweep_extend_adds_only_new_trials(live_url: str, db: Database, tmp_path: Path) -> None:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({**SWEEP, "seeds": 1}))
    assert ddpq(live_url, "sweep", "submit", str(path)).exit_code == 0
    r = ddpq(live_url, "sweep", "extend", "1", "--axis", "training.lr=0.01,3e-2")
    assert r.exit_code == 0, r.output
    assert "sweep 1: 1 trial(s) added; 4 trials: 4 queued" in r.output, "0.01 ran already"
    ext = tmp_path / "ext.json"
    ext.write_text(json.dumps({"axes": {"training.lr": {"grid": [0.5]}}}))
    r = ddpq(live_url, "sweep", "extend", "1", "--file", str(ext), "--seeds", "2")
    assert r.exit_code == 0 and "6 trial(s) added; 10 trials" in r.output, r.output
    trials = json.loads(ddpq(live_url, "sweep", "show", "1", "--json").output)["trials"]
    assert sorted({t["overrides"]["training.lr"] for t in trials}) == [0.001, 0.01, 0.03, 0.1, 0.5]
    assert len({t["key"] for t in trials}) == len(trials) == 10, "5 lr values × 2 seeds"
    with db.session(write=False) as s:
        job = s.get(Job, trials[-1]["job_id"])
        assert job is not None
        assert job.spec["training"]["lr"] == trials[-1]["overrides"]["training.lr"]

    r = ddpq(live_url, "sweep", "submit", str(path), "--idempotency-key", "k")
    assert r.exit_code == 0 and "sweep 2 " in r.output, r.output
    r = ddpq(live_url, "sweep", "submit", str(path), "--idempotency-key", "k")
    assert r.exit_code == 0 and "sweep 2 " in r.output, "a resubmit returns the same sweep"
    page = json.loads(ddpq(live_url, "sweep", "ls", "--json").output)
    assert [s["id"] for s in page["sweeps"]] == [2, 1], "no third sweep"

    r = ddpq(live_url, "sweep", "extend", "1")
    assert r.exit_code == 2 and "nothing to extend" in r.output and "fix:" in r.output
    r = ddpq(live_url, "sweep", "extend", "1", "--axis", "training.lr")
    assert r.exit_code == 2 and "--axis PATH=V1,V2" in r.output, r.output
    r = ddpq(live_url, "sweep", "extend", "1", "--axis", "config.hidden=8")
    assert r.exit_code == 2 and "not an axis of this sweep" in r.output, r.output
    r = ddpq(live_url, "sweep", "extend", "1", "--seeds", "1")
    assert r.exit_code == 2 and "trials are never removed" in r.output, r.output
    r = ddpq(live_url, "sweep", "extend", "99", "--seeds", "3")
    assert r.exit_code == 2 and "sweep 99 not found" in r.output
