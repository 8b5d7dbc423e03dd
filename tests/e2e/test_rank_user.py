"""``DDPQ_RANK_USER``: a root-run worker starts its ranks as another Unix user, who cannot
read the database file, the worker's environment or its user token.

Needs root (CI runs as root), ``useradd`` (the test creates the system user
``ddpq-rank-test`` once), and an interpreter and checkout that user can run and import (a
venv whose interpreter lies under a 0700 ``/root`` cannot be run by anyone else: then these
tests skip and say so). Everything lives in a 0755 directory under /tmp: pytest's own
``tmp_path`` is 0700 root.

Two levels: the local launcher with the probe as its per-rank program (the launcher's part
alone), and a whole job (API + worker processes, the probe as a user entrypoint through the
rank runtime).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.core import artifacts
from service.core.config import Settings
from service.core.spec import JobSpec
from service.store.db import Database
from service.store.migrate import upgrade
from worker.launchers.base import RunPhase, RunStatus, with_attempt_token
from worker.launchers.local import LocalLauncher
from worker.up import settings_env

RANK_USER = "ddpq-rank-test"
REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("rank_user_probe.py")
SLOW_BOX_S = 240.0
DB_SECRET = "DDPQ_DATABASE_URL"


def _skip_unless_rank_user_can_run_python() -> None:
    check = subprocess.run(
        ["runuser", "-u", RANK_USER, "--", sys.executable, "-c",
         "import service, worker.runtime, tests.e2e.rank_user_probe"],
        env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO)},
        cwd="/", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if check.returncode != 0:
        pytest.skip(
            f"user {RANK_USER} cannot run {sys.executable} and import ddpq from {REPO} "
            f"({check.stderr.strip().splitlines()[-1:]}): the interpreter, the venv and the "
            "checkout must be readable by the rank user (e.g. not under a 0700 /root)"
        )


@pytest.fixture(scope="module")
def rank_user() -> str:
    """The rank user, created if absent (root only)."""
    if os.geteuid() != 0:
        pytest.skip("DDPQ_RANK_USER needs a root-run worker; run these tests as root")
    try:
        pwd.getpwnam(RANK_USER)
    except KeyError:
        if shutil.which("useradd") is None:
            pytest.skip(f"no useradd to create the test user {RANK_USER}")
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
             RANK_USER], check=True, capture_output=True, timeout=60,
        )  # fmt: skip
    _skip_unless_rank_user_can_run_python()
    return RANK_USER


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A 0755 directory the rank user can traverse (pytest's tmp_path is 0700 root)."""
    path = Path(tempfile.mkdtemp(prefix="ddpq-rank-user-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _settings(root: Path, **overrides: Any) -> Settings:
    return Settings(
        home=root / ".ddpq",
        database_url=f"sqlite:///{root / 'ddpq.db'}",
        artifact_dir=root / "artifacts",
        **overrides,
    )


def _probes(settings: Settings, job_id: int, attempt: int, nproc: int) -> list[dict[str, Any]]:
    attempt_dir = artifacts.attempt_dir(settings.resolved_artifact_dir, job_id, attempt)
    paths = [attempt_dir / f"user-probe-rank-{r}.json" for r in range(nproc)]
    missing = [p.name for p in paths if not p.exists()]
    assert not missing, f"ranks left no probe file: {missing} in {sorted(attempt_dir.iterdir())}"
    return [json.loads(p.read_text()) for p in paths]


def _check_isolated(probes: list[dict[str, Any]], uid: int) -> None:
    for probe in probes:
        assert probe["uid"] == uid, f"rank ran as uid {probe['uid']}, expected {uid}"
        assert probe["db"] == "PermissionError", (
            f"the rank user must not open the database file, got {probe['db']}"
        )
        assert probe["spec"] == "readable", "the rank user must read its own spec.json"
        assert DB_SECRET not in probe["ddpq_env"] and "DDPQ_TOKEN" not in probe["ddpq_env"]
        assert "DDPQ_ATTEMPT_TOKEN" in probe["ddpq_env"] and "DDPQ_API_URL" in probe["ddpq_env"]
        leaked = {pid: what for pid, what in probe["ancestors"].items() if what == "secret"}
        assert not leaked, f"an ancestor's environment names a worker secret: {leaked}"


def _wait_end(launcher: LocalLauncher, handle: str) -> RunStatus:
    deadline = time.monotonic() + SLOW_BOX_S
    while time.monotonic() < deadline:
        status = launcher.poll(handle)
        if status.phase not in (RunPhase.PENDING, RunPhase.RUNNING):
            return status
        time.sleep(0.2)
    launcher.cancel(handle)
    raise AssertionError(f"the attempt did not end within {SLOW_BOX_S:.0f} s")


def test_the_local_launcher_runs_ranks_as_the_rank_user(
    rank_user: str, shared_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DB_SECRET, "postgresql://u:secret@db.example/ddpq")
    monkeypatch.setenv("DDPQ_TOKEN", "ddpq_user-token")
    settings = _settings(shared_dir, rank_user=rank_user)
    db = Database.from_url(settings.resolved_database_url)
    upgrade(db.engine)
    db.dispose()
    db_path = shared_dir / "ddpq.db"
    launcher = LocalLauncher(settings, cwd=REPO, entry=(str(PROBE),))
    spec = JobSpec.model_validate(
        {"name": "u", "task": "regression", "resources": {"nproc_per_node": 2}}
    )
    plan = with_attempt_token(launcher.plan(spec, 1, 1), "ddpqa_test-token")
    plan = replace(plan, env={**plan.env, "PROBE_DB_PATH": str(db_path)})
    status = _wait_end(launcher, launcher.start(plan))
    log = (Path(plan.log_dir) / "launcher.log").read_text(errors="replace")[-3000:]
    assert status.phase == RunPhase.SUCCEEDED, f"{status}\n{log}"
    user = pwd.getpwnam(rank_user)
    probes = _probes(settings, 1, 1, 2)
    _check_isolated(probes, user.pw_uid)
    assert all(p["home"] == (user.pw_dir or "/") for p in probes), probes
    attempt_dir = Path(plan.log_dir)
    assert attempt_dir.stat().st_uid == user.pw_uid, "the attempt directory is the rank user's"
    spec_file = attempt_dir / "spec.json"
    assert spec_file.stat().st_uid == user.pw_uid and spec_file.stat().st_mode & 0o777 == 0o600
    assert db_path.stat().st_uid == 0 and db_path.stat().st_mode & 0o777 == 0o600


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_whole_job_runs_as_the_rank_user_and_cannot_read_the_database(
    rank_user: str, shared_dir: Path
) -> None:
    settings = _settings(
        shared_dir,
        rank_user=rank_user,
        port=_free_port(),
        heartbeat_interval_s=0.3,
        allowed_entrypoints=["tests.e2e.rank_user_probe:*"],
    )
    db = Database.from_url(settings.resolved_database_url)
    upgrade(db.engine)
    db.dispose()
    env = {**os.environ, **settings_env(settings), "DDPQ_TOKEN": "ddpq_user-token"}
    py = sys.executable
    argvs = {
        "api": [py, "-m", "worker.up", "serve-api", "127.0.0.1", str(settings.port)],
        "worker": [py, "-m", "worker.main", "--slots", "1", "--gpus", "none"],
    }
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {name: shared_dir / f"{name}.log" for name in argvs}
    url = settings.resolved_api_url
    try:
        for name, argv in argvs.items():
            with open(logs[name], "wb") as out:
                procs[name] = subprocess.Popen(argv, env=env, cwd=REPO, stdout=out,
                                               stderr=subprocess.STDOUT)  # fmt: skip
            if name == "api":
                _wait(lambda: _answers(f"{url}/readyz"), "the API to answer /readyz")
        spec = {"name": "probe", "task": "tests.e2e.rank_user_probe:probe",
                "config": {"db_path": str(shared_dir / "ddpq.db")},
                "resources": {"nproc_per_node": 2, "timeout_min": 5}}  # fmt: skip
        with httpx.Client(base_url=f"{url}/api/v1", timeout=30) as http:
            created = http.post("/jobs", json=spec)
            assert created.status_code == 201, created.text
            job_id = int(created.json()["id"])

            def ended() -> dict[str, Any] | None:
                job: dict[str, Any] = http.get(f"/jobs/{job_id}").json()
                return job if job["state"] in ("succeeded", "failed", "cancelled") else None

            job = _wait(ended, f"job {job_id} to end")
        diagnostics = "\n".join(f"--- {n}\n{p.read_text(errors='replace')[-3000:]}"
                                for n, p in logs.items())  # fmt: skip
        assert job["state"] == "succeeded", f"{job['error']}\n{diagnostics}"
        _check_isolated(_probes(settings, job_id, 1, 2), pwd.getpwnam(rank_user).pw_uid)
    finally:
        for proc in reversed(list(procs.values())):
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _wait(cond: Any, what: str) -> Any:
    deadline = time.monotonic() + SLOW_BOX_S
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out after {SLOW_BOX_S:.0f} s waiting for {what}")
