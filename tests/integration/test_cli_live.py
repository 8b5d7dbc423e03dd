"""The `ddpq` CLI against a live uvicorn server (real HTTP) on SQLite and PostgreSQL, and
`ddpq db upgrade` + `ddpq serve` as real processes."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from service.cli.main import app
from service.core import artifacts
from service.core.config import Settings
from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.store.checkpoints import crud as checkpoints
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs import crud as jobs
from service.store.metrics import points as metrics
from service.store.metrics.points import MetricPoint
from service.store.workers import registry as workers

runner = CliRunner()
SPEC: dict[str, Any] = {"name": "digits-2", "task": "digits", "resources": {"nproc_per_node": 2}}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def ddpq(url: str, *args: str, env: dict[str, str] | None = None) -> Any:
    return runner.invoke(
        app, list(args), env={"DDPQ_API_URL": url, "COLUMNS": "250", **(env or {})}
    )


def spec_file(tmp_path: Path, spec: dict[str, Any], suffix: str = ".yaml") -> Path:
    path = tmp_path / f"job{suffix}"
    path.write_text(json.dumps(spec) if suffix == ".json" else yaml.safe_dump(spec))
    return path


def test_submit_ls_show_metrics_logs_cancel(
    live_url: str, tmp_path: Path, db: Database, settings: Settings
) -> None:
    result = ddpq(live_url, "submit", str(spec_file(tmp_path, SPEC)), "--name", "cli-job")
    assert result.exit_code == 0, result.output
    with db.session(write=False) as s:
        listed, _ = jobs.list_jobs(s)
    assert [j.name for j in listed] == ["cli-job"]
    job_id = listed[0].id
    assert f"job {job_id}" in result.output and f"{live_url}/jobs/{job_id}" in result.output

    again = ddpq(
        live_url, "submit", str(spec_file(tmp_path, SPEC, ".json")), "--idempotency-key", "k"
    )
    assert again.exit_code == 0
    replay = ddpq(
        live_url, "submit", str(spec_file(tmp_path, SPEC, ".json")), "--idempotency-key", "k"
    )
    assert replay.exit_code == 0
    second_id = job_id + 1
    assert f"job {second_id}" in again.output and f"job {second_id}" in replay.output

    ls = ddpq(live_url, "ls")
    assert ls.exit_code == 0 and "cli-job" in ls.output and "digits-2" in ls.output
    assert ls.output.index("digits-2") < ls.output.index("cli-job"), "newest first"
    narrow = ddpq(live_url, "ls", env={"COLUMNS": "80"})
    assert narrow.exit_code == 0
    assert all(len(line) <= 80 for line in narrow.output.splitlines()), narrow.output
    for jid in (job_id, second_id):
        assert re.search(rf"^\s*{jid}\s+\S+\s+queued\s+1\s.*\s(just now|\d+s ago)\s*$",
                         narrow.output, re.M), narrow.output  # fmt: skip
    assert "queued" in ddpq(live_url, "ls", "--state", "queued").output
    bad_state = ddpq(live_url, "ls", "--state", "bogus")
    assert bad_state.exit_code == 2 and "state:" in bad_state.output

    with db.session() as s:
        workers.register_worker(s, worker_id="w", host="h", pid=1, launcher="local", capacity={})
    with db.session() as s:
        claims.claim_next_job(s, worker_id="w", launcher="local", max_gpus_per_node=0, lease_s=30)
        jobs.apply_transition(s, jobs.Transition(job_id, JobState.STARTING, JobState.RUNNING))
        progress = {"step": 3, "total_steps": 400, "epoch": 1, "samples_per_s": 123.4, "eta_s": 80}
        metrics.record_metrics(
            s, job_id, 1, [MetricPoint("loss", i, 1 / i) for i in (1, 2, 3)], progress=progress
        )
    log = artifacts.rank_log_path(settings.resolved_artifact_dir, job_id, 1, 1)
    log.parent.mkdir(parents=True)
    log.write_text("hello from rank 1\n[bold]not markup[/bold]\n")

    show = ddpq(live_url, "show", str(job_id))
    assert show.exit_code == 0 and "running" in show.output and "claimed" in show.output
    assert "step 3/400 · epoch 2 · 123 samples/s · ETA 1m20s" in show.output, show.output
    waiting = ddpq(live_url, "show", str(second_id))
    assert re.search(r"queued\s+waiting for a free slot \(1 live worker, all busy\)",
                     waiting.output), waiting.output  # fmt: skip
    out = ddpq(live_url, "metrics", str(job_id), "--name", "loss")
    assert out.exit_code == 0 and "0.333333" in out.output
    missing_metric = ddpq(live_url, "metrics", str(job_id), "--name", "accuracy")
    assert missing_metric.exit_code == 2, missing_metric.output
    assert f"job {job_id} has no metric 'accuracy'; it reports: loss" in missing_metric.output
    none_yet = ddpq(live_url, "metrics", str(second_id), "--name", "loss")
    assert none_yet.exit_code == 2 and "reported none yet" in none_yet.output
    first_two = ddpq(live_url, "metrics", str(job_id), "--limit", "2")
    assert "first 2 points shown; more with --after-step 2" in first_two.output, first_two.output
    assert "more with" not in out.output, "all 3 points shown: no hint"
    later = ddpq(live_url, "metrics", str(job_id), "--after-step", "3")
    assert later.exit_code == 0 and "no 'loss' points after step 3" in later.output
    logs = ddpq(live_url, "logs", str(job_id), "--rank", "1")
    assert logs.output == "hello from rank 1\n[bold]not markup[/bold]\n"
    assert ddpq(live_url, "logs", str(job_id), "--rank", "-1").exit_code == 2
    no_rank = ddpq(live_url, "logs", str(job_id), "--rank", "5")
    assert no_rank.exit_code == 2, no_rank.output
    assert f"job {job_id} has ranks 0–1" in no_rank.output
    elsewhere = ddpq(live_url, "logs", str(job_id), "--rank", "0")  # ran, its log not here
    assert elsewhere.exit_code == 0, elsewhere.output
    assert f"no log of rank 0 of job {job_id} attempt 1 on the API's host" in elsewhere.output
    assert "artifact dir of the worker that ran it" in elsewhere.output, elsewhere.output

    cancel = ddpq(live_url, "cancel", str(job_id))
    assert cancel.exit_code == 0 and "cancel requested" in cancel.output

    def finish() -> None:  # the worker's part: last words in the log, then cancelled
        time.sleep(0.5)
        with log.open("a") as f:
            f.write("last line\n")
        with db.session() as s:
            jobs.apply_transition(
                s, jobs.Transition(job_id, JobState.RUNNING, JobState.CANCELLED, "cancelled")
            )

    finisher = threading.Thread(target=finish)
    finisher.start()
    followed = ddpq(live_url, "logs", str(job_id), "--rank", "1", "--follow", "--poll-s", "0.1")
    finisher.join(10)
    assert followed.exit_code == 0, followed.output
    assert followed.output == "hello from rank 1\n[bold]not markup[/bold]\nlast line\n"

    cancel_queued = ddpq(live_url, "cancel", str(second_id))
    assert cancel_queued.exit_code == 0 and "cancelled" in cancel_queued.output
    finished = ddpq(live_url, "cancel", str(second_id))
    assert finished.exit_code == 1 and "409" in finished.output
    never_ran = ddpq(live_url, "logs", str(second_id))
    assert never_ran.exit_code == 0, never_ran.output
    assert f"rank 0 of job {second_id} logged nothing in attempt 1 (yet)" in never_ran.output
    missing = ddpq(live_url, "show", "99999")
    assert missing.exit_code == 2 and "not found" in missing.output


def test_bad_spec_prints_each_field_and_exits_2(
    live_url: str, tmp_path: Path, db: Database
) -> None:
    spec = {**SPEC, "resources": {"nproc_per_node": 0}, "backend": "nccl", "colour": 1}
    result = ddpq(live_url, "submit", str(spec_file(tmp_path, spec)))
    assert result.exit_code == 2, result.output
    assert "resources.nproc_per_node:" in result.output
    assert "colour:" in result.output
    assert "Traceback" not in result.output
    with db.session(write=False) as s:
        assert jobs.list_jobs(s)[0] == []


def test_control_characters_are_escaped_and_reused_keys_refused(
    live_url: str, tmp_path: Path, db: Database
) -> None:
    evil = "red\x1b[31m\x1b]0;pwned\x07[bold]x"
    first = ddpq(live_url, "submit", str(spec_file(tmp_path, {**SPEC, "name": evil})),
                 "--idempotency-key", "k1")  # fmt: skip
    assert first.exit_code == 0, first.output
    listing = ddpq(live_url, "ls")
    assert listing.exit_code == 0, listing.output
    for output in (first.output, listing.output, ddpq(live_url, "show", "1").output):
        assert "\x1b" not in output and "\x07" not in output, repr(output)
        assert "red\\x1b[31m" in output and "[bold]x" in output, output
    other = spec_file(tmp_path, {**SPEC, "name": "other"}, ".json")
    reused = ddpq(live_url, "submit", str(other), "--idempotency-key", "k1")
    assert reused.exit_code == 2, reused.output
    assert "Idempotency-Key: Idempotency-Key 'k1' was used for a different spec" in reused.output
    with db.session(write=False) as s:
        assert len(jobs.list_jobs(s)[0]) == 1


def _drive_job(db: Database, settings: Settings, outcome: JobState) -> int:
    """Stand-in for a worker (through the real domain functions): claim the queued job, run
    4 steps with progress and metrics, write a checkpoint, then end in ``outcome``."""
    deadline = time.monotonic() + 30
    job = None
    while job is None and time.monotonic() < deadline:
        with db.session() as s:
            job = claims.claim_next_job(
                s, worker_id="w", launcher="local", max_gpus_per_node=0, lease_s=30
            )
            job_id = job.id if job else 0
        time.sleep(0.05)
    assert job is not None, "the CLI never submitted"
    with db.session() as s:
        jobs.apply_transition(s, jobs.Transition(job_id, JobState.STARTING, JobState.RUNNING))
    for step in range(1, 5):
        progress = {"step": step, "total_steps": 4, "epoch": 0, "samples_per_s": 100.0, "eta_s": 1}
        with db.session() as s:
            metrics.record_metrics(
                s, job_id, 1, [MetricPoint("loss", step, 1.0 / step, 0)], progress=progress
            )
        time.sleep(0.15)
    path = artifacts.checkpoint_path(settings.resolved_artifact_dir, job_id, 4)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"weights" * 100)
    with db.session() as s:
        metrics.record_metrics(s, job_id, 1, [MetricPoint("eval_accuracy", 4, 0.9722)])
        checkpoints.record_checkpoint(
            s, job_id, 1, step=4, epoch=0, path=str(path), size_bytes=700,
            sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
        )  # fmt: skip
        error = "rank 1 raised RuntimeError: boom" if outcome == JobState.FAILED else None
        jobs.apply_transition(
            s, jobs.Transition(job_id, JobState.RUNNING, outcome, "done"), error=error
        )
    return job_id


@pytest.mark.parametrize("outcome", [JobState.SUCCEEDED, JobState.FAILED])
def test_submit_wait_follows_the_job_to_its_end(
    live_url: str, tmp_path: Path, db: Database, settings: Settings, outcome: JobState
) -> None:
    with db.session() as s:
        workers.register_worker(s, worker_id="w", host="h", pid=1, launcher="local", capacity={})
    errors: list[BaseException] = []
    driven: list[int] = []

    def drive() -> None:
        try:
            driven.append(_drive_job(db, settings, outcome))
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    driver = threading.Thread(target=drive)
    driver.start()
    # The succeeded run shares the server's artifact dir (the file is local), the failed not.
    local = outcome == JobState.SUCCEEDED
    env = {"DDPQ_ARTIFACT_DIR": str(settings.resolved_artifact_dir)} if local else {}
    args = ("submit", str(spec_file(tmp_path, SPEC)), "--wait", "--poll-s", "0.1")
    result = ddpq(live_url, *args, env=env)
    driver.join(30)
    assert not errors, errors
    job_id = driven[0]
    out = result.output
    assert result.exit_code == (0 if outcome == JobState.SUCCEEDED else 1), out
    assert outcome.value in out
    assert "eval_accuracy" in out and "0.9722 (97.22%)" in out
    sha = hashlib.sha256(b"weights" * 100).hexdigest()
    assert "step 4" in out and sha in out and "700 B" in out
    assert f"{live_url}{API_PREFIX}/jobs/{job_id}/checkpoints/4/file" in out
    assert f"{live_url}/jobs/{job_id}" in out
    assert ("rank 1 raised RuntimeError: boom" in out) == (outcome == JobState.FAILED)
    relative = f"jobs/{job_id}/checkpoints/step-4.pt"
    if local:
        shown = re.escape(str(settings.resolved_artifact_dir / relative)) + r"\s*$"
    else:  # the server's path, saying where it is
        shown = re.escape(f"{relative} (in the API server's artifact dir")
    assert re.search(rf"^file\s+{shown}", out, re.M), out
    bar = next(line for line in out.splitlines() if line.lstrip().startswith(("✓", "✗")))
    assert f"job {job_id} {outcome.value}" in bar and "step 4/4" in bar, bar
    assert not re.search("[\u2800-\u28ff]", out), "the spinner must not stay on the last line"


def _ddpq_exe() -> str:
    exe = shutil.which("ddpq", path=str(Path(sys.executable).parent))
    assert exe, "the ddpq console script is not installed: pip install -e ."
    return exe


def _children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc/<pid>/stat's 4th field)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[1] == str(pid):
            found.append(int(entry.name))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_db_upgrade_then_serve_answers_ready(tmp_path: Path, workers: int) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("DDPQ_")},
        "DDPQ_HOME": str(tmp_path / "home"),
        "OMP_NUM_THREADS": "1",
    }
    port = free_port()
    refused = subprocess.run(
        [_ddpq_exe(), "serve", "--port", str(port)], env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert "ddpq db upgrade" in refused.stderr and "Traceback" not in refused.stderr
    upgrade = subprocess.run(
        [_ddpq_exe(), "db", "upgrade"], env=env, capture_output=True, text=True, timeout=120
    )
    assert upgrade.returncode == 0, upgrade.stderr
    assert (tmp_path / "home" / "ddpq.db").exists()
    current = subprocess.run(
        [_ddpq_exe(), "db", "current"], env=env, capture_output=True, text=True, timeout=120
    )
    assert "behind" not in current.stdout and "current: 0" in current.stdout
    server = subprocess.Popen(
        [_ddpq_exe(), "serve", "--host", "127.0.0.1", "--port", str(port),
         "--workers", str(workers)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, server.stdout.read() if server.stdout else ""
            assert time.monotonic() < deadline, "ddpq serve did not answer /readyz in 60 s"
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert r.json() == {"status": "ok"}
        if workers > 1:  # uvicorn's supervisor runs one process per worker
            assert len(_children(server.pid)) >= workers, _children(server.pid)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
