"""``DDPQ_RANK_USER``: a root-run worker starts its ranks as another Unix user, who cannot
read the database file, the worker's environment or its user token.

Needs root (CI runs as root) and ``useradd`` (the test creates the system user
``ddpq-rank-test`` once). The rank user must run an interpreter and import ddpq: a venv whose
interpreter lies under a 0700 ``/root`` (pyenv, a fresh clone in root's home) cannot be run by
anyone else, so the set-up provides what it can (``rank_python``): a venv under a 0755 temp
dir from a system Python of the same minor version whose ``.pth`` names this venv's
site-packages, and a copy of the code the ranks import when the checkout is not readable to
that user. The tests skip, saying which part is missing, only when none of that works.
Everything lives in 0755 directories under /tmp: pytest's own ``tmp_path`` is 0700 root.

Two levels: the local launcher with the probe as its per-rank program (the launcher's part
alone), and a whole job (API + worker processes, the probe as a user entrypoint through the
rank runtime). And ``DDPQ_RANK_USERS``: two owners' jobs at once on one launcher, each run as
its owner's user, and one owner's user cannot read the other's attempt directory, workspace,
log or checkpoints.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.core import artifacts
from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.core.wire import API_PREFIX
from service.store.db import Database
from service.store.migrate import upgrade
from tests.workers import mint_worker_token, worker_environ
from worker.errors import LaunchError
from worker.launchers.base import RunPhase, RunStatus, with_attempt_token, with_owner
from worker.launchers.local.launcher import LocalLauncher
from worker.up import settings_env

RANK_USER = "ddpq-rank-test"
OTHER_RANK_USER = "ddpq-rank-test-b"  # owner bob's, in the two-owner test (alice: RANK_USER)
REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("rank_user_probe.py")
SLOW_BOX_S = 240.0
DB_SECRET = "DDPQ_DATABASE_URL"


MINOR = f"{sys.version_info[0]}.{sys.version_info[1]}"
# What a rank of these tests imports: the runtime (and so torch) and the probe.
RANK_IMPORTS = "import torch, service, worker.runtime, tests.e2e.rank_user_probe"


@dataclass(frozen=True)
class RankPython:
    """What the rank user runs: ``python`` (torchrun's and so every rank's interpreter) and
    ``code``, the directory on their ``PYTHONPATH`` and their working directory."""

    python: str
    code: Path

    @property
    def probe(self) -> Path:
        """The probe script inside ``code``."""
        return self.code / "tests" / "e2e" / PROBE.name


def _as_rank_user(argv: list[str], pythonpath: Path | None = None) -> str | None:
    """Run ``argv`` as the rank user from ``/``: None when it exits 0, else why not (its
    last line of stderr)."""
    env = {"PATH": os.environ.get("PATH", "")}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    try:
        done = subprocess.run(
            ["runuser", "-u", RANK_USER, "--", *argv],
            env=env, cwd="/", capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit code {done.returncode}"


def _system_python() -> str | None:
    """A Python of this interpreter's minor version that the rank user can run, or None."""
    name = f"python{MINOR}"
    for candidate in (f"/usr/bin/{name}", f"/usr/local/bin/{name}"):
        if not os.access(candidate, os.X_OK):
            continue
        same_minor = f"import sys; sys.exit(sys.version_info[:2] != {sys.version_info[:2]!r})"
        if _as_rank_user([candidate, "-c", same_minor]) is None:
            return candidate
    return None


def _venv_over_these_site_packages(root: Path, base: str) -> str:
    """A venv under ``root`` from ``base`` (no pip) whose ``.pth`` names this interpreter's
    site-packages, so the rank user imports the very packages the tests run with; its
    interpreter. A plain path per line, not this venv's own ``.pth`` hooks: those would also
    add the editable install's checkout, and the ranks import the code on their PYTHONPATH."""
    venv = root / "venv"
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)],
                   check=True, capture_output=True, timeout=120)  # fmt: skip
    site = venv / "lib" / f"python{MINOR}" / "site-packages"
    paths = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site / "ddpq-tests-site-packages.pth").write_text("".join(f"{p}\n" for p in paths))
    return str(venv / "bin" / "python")


def _copy_of_the_code(root: Path) -> Path:
    """What the ranks and the worker import, copied under ``root`` and readable by all:
    ``service/``, ``worker/``, ``migrations/`` and the probe (``tests.e2e`` as namespace
    packages, as in the checkout)."""
    code = root / "code"
    for name in ("service", "worker", "migrations"):
        shutil.copytree(REPO / name, code / name, ignore=shutil.ignore_patterns("__pycache__"))
    (code / "tests" / "e2e").mkdir(parents=True)
    shutil.copy2(PROBE, code / "tests" / "e2e" / PROBE.name)
    for path in [code, *code.rglob("*")]:
        extra = stat.S_IROTH | (stat.S_IXOTH if path.is_dir() else 0)
        path.chmod(path.stat().st_mode | extra)
    return code


def _rank_python(root: Path) -> RankPython:
    """An interpreter and code the rank user can run and import (see the module docstring);
    skips with the missing part named when there is none."""
    python = sys.executable
    cannot_run = _as_rank_user([python, "-c", "pass"])
    if cannot_run is not None:
        base = _system_python()
        if base is None:
            pytest.skip(
                f"user {RANK_USER} cannot run {python} ({cannot_run}) and there is no "
                f"/usr/bin/python{MINOR} or /usr/local/bin/python{MINOR} it can run to build "
                "a venv from"
            )
        python = _venv_over_these_site_packages(root, base)
    probe = str(PROBE.relative_to(REPO))
    unreadable = _as_rank_user(["test", "-r", str(REPO / probe)])
    code = REPO if unreadable is None else _copy_of_the_code(root)
    cannot_import = _as_rank_user([python, "-c", RANK_IMPORTS], pythonpath=code)
    if cannot_import is not None:
        pytest.skip(
            f"user {RANK_USER} runs {python} but cannot import ddpq and torch from {code} and "
            f"{sorted(set(sysconfig.get_paths()[k] for k in ('purelib', 'platlib')))} "
            f"({cannot_import}): this venv's site-packages must be readable by that user"
        )
    return RankPython(python=python, code=code)


def _test_user(name: str) -> str:
    """The Unix user ``name``, created if absent (root only; skips otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("DDPQ_RANK_USER needs a root-run worker; run these tests as root")
    try:
        pwd.getpwnam(name)
    except KeyError:
        if shutil.which("useradd") is None:
            pytest.skip(f"no useradd to create the test user {name}")
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
             name], check=True, capture_output=True, timeout=60,
        )  # fmt: skip
    return name


@pytest.fixture(scope="module")
def rank_user() -> str:
    """The rank user, created if absent (root only)."""
    return _test_user(RANK_USER)


@pytest.fixture(scope="module")
def rank_python(rank_user: str) -> Iterator[RankPython]:
    """An interpreter and code ``rank_user`` can run and import, under a 0755 temp dir when
    the test's own are out of its reach (removed afterwards)."""
    root = Path(tempfile.mkdtemp(prefix="ddpq-rank-python-"))
    root.chmod(0o755)
    try:
        yield _rank_python(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


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
    rank_user: str, rank_python: RankPython, shared_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DB_SECRET, "postgresql://u:secret@db.example/ddpq")
    monkeypatch.setenv("DDPQ_TOKEN", "ddpq_user-token")
    # The ranks inherit the worker's PYTHONPATH (an allowed name): the code they can read.
    monkeypatch.setenv("PYTHONPATH", str(rank_python.code))
    settings = _settings(shared_dir, rank_user=rank_user)
    db = Database.from_url(settings.resolved_database_url)
    upgrade(db.engine)
    db.dispose()
    db_path = shared_dir / "ddpq.db"
    launcher = LocalLauncher(
        settings, cwd=rank_python.code, entry=(str(rank_python.probe),), python=rank_python.python
    )
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
    rank_user: str, rank_python: RankPython, shared_dir: Path
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
    token = mint_worker_token(db)
    db.dispose()
    env = {**os.environ, **settings_env(settings), "DDPQ_TOKEN": "ddpq_user-token"}
    # The worker runs torchrun with its own interpreter, from its own working directory, with
    # its PYTHONPATH: the ones the rank user can run and read. It holds a worker token, no
    # database URL.
    worker_env = {**worker_environ(settings, token, env), "PYTHONPATH": str(rank_python.code)}
    argvs = {
        "api": [sys.executable, "-m", "worker.up", "serve-api", "127.0.0.1", str(settings.port)],
        "worker": [rank_python.python, "-m", "worker.main", "--slots", "1", "--gpus", "none"],
    }
    envs = {"api": env, "worker": worker_env}
    cwds = {"api": REPO, "worker": rank_python.code}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {name: shared_dir / f"{name}.log" for name in argvs}
    url = settings.resolved_api_url
    try:
        for name, argv in argvs.items():
            with open(logs[name], "wb") as out:
                procs[name] = subprocess.Popen(argv, env=envs[name], cwd=cwds[name],
                                               stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
            if name == "api":
                _wait(lambda: _answers(f"{url}/readyz"), "the API to answer /readyz")
        spec = {"name": "probe", "task": "tests.e2e.rank_user_probe:probe",
                "config": {"db_path": str(shared_dir / "ddpq.db")},
                "resources": {"nproc_per_node": 2, "timeout_min": 5}}  # fmt: skip
        with httpx.Client(base_url=f"{url}{API_PREFIX}", timeout=30) as http:
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


# Each rank of the two-owner test, as its owner's user: it leaves on the host what a job of
# that owner leaves (a workspace file, a rank log, a local checkpoint), says its pid, and
# runs until the test releases it, so that both owners' jobs run at once.
OWNER_RANK = """
import json, os, time
from pathlib import Path

job = Path(os.environ["DDPQ_ARTIFACT_DIR"]) / "jobs" / os.environ["DDPQ_JOB_ID"]
here = job / ("attempt-" + os.environ["DDPQ_ATTEMPT"])
(here / "workspace").mkdir()
(here / "workspace" / "train.py").write_text("the owner's own code\\n")
(here / "rank-0.log").write_text("the owner's log\\n")
(job / "checkpoints" / "step-1.pt").write_bytes(b"the owner's weights")
print("torchrun's log of job", os.environ["DDPQ_JOB_ID"], flush=True)
(here / "pid-rank-0").write_text(str(os.getpid()))
deadline = time.monotonic() + 120
while not (here / "release").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
(here / "result.json").write_text(json.dumps(
    {"status": "succeeded", "step": 0, "final_metrics": {}, "checkpoint": None}))
"""
# Run as another user: what of ``argv``'s paths it can read (a directory: list).
READER = """
import json, os, sys
seen = {}
for path in sys.argv[1:]:
    try:
        os.listdir(path) if os.path.isdir(path) else open(path, "rb").read(1)
        seen[path] = "read"
    except OSError as exc:
        seen[path] = type(exc).__name__
print(json.dumps(seen))
"""


def _uid_of(pid: int) -> int:
    """The real uid of process ``pid``, from ``/proc/<pid>/status``."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])


def _files_of(settings: Settings, job_id: int) -> list[Path]:
    """What a job leaves on the host that only its owner's user may read."""
    job = artifacts.job_dir(settings.resolved_artifact_dir, job_id)
    attempt = artifacts.attempt_dir(settings.resolved_artifact_dir, job_id, 1)
    return [attempt, attempt / "workspace" / "train.py", attempt / "rank-0.log",
            attempt / "launcher.log", attempt / "spec.json", job / "checkpoints",
            job / "checkpoints" / "step-1.pt"]  # fmt: skip


def test_each_owners_job_runs_as_its_own_user_and_cannot_read_anothers(
    rank_user: str, rank_python: RankPython, shared_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bob_user = _test_user(OTHER_RANK_USER)
    monkeypatch.setenv("PYTHONPATH", str(rank_python.code))
    settings = _settings(shared_dir, rank_users={"alice": rank_user, "bob": bob_user})
    entry = shared_dir / "owner_rank.py"
    entry.write_text(OWNER_RANK)
    entry.chmod(0o644)
    launcher = LocalLauncher(
        settings, cwd=rank_python.code, entry=(str(entry),), python=rank_python.python
    )
    spec = JobSpec.model_validate({"name": "o", "task": "regression"})
    owners = {1: "alice", 2: "bob"}
    plans = {job_id: with_owner(with_attempt_token(launcher.plan(spec, job_id, 1), "ddpqa_t"),
                                owner) for job_id, owner in owners.items()}  # fmt: skip
    # An owner the worker's map does not cover: no rank starts (the job fails at launch).
    with pytest.raises(LaunchError, match=r"owner 'carol' has no Unix user.*DDPQ_RANK_USERS"):
        launcher.start(with_owner(launcher.plan(spec, 3, 1), "carol"))
    handles = {job_id: launcher.start(plan) for job_id, plan in plans.items()}
    uids = {1: pwd.getpwnam(rank_user).pw_uid, 2: pwd.getpwnam(bob_user).pw_uid}
    try:
        pid_files = {j: Path(plans[j].log_dir) / "pid-rank-0" for j in plans}
        _wait(lambda: all(p.exists() and p.read_text() for p in pid_files.values()),
              "both jobs' ranks to start")  # fmt: skip
        for job_id, path in pid_files.items():
            assert _uid_of(int(path.read_text())) == uids[job_id], owners[job_id]
            assert _uid_of(int(handles[job_id])) == uids[job_id], "torchrun runs as the owner"
            for f in _files_of(settings, job_id):
                assert f.stat().st_uid == uids[job_id], f
        attempt_dir = Path(plans[1].log_dir)
        assert attempt_dir.stat().st_mode & 0o777 == 0o700
        assert attempt_dir.parent.stat().st_mode & 0o777 == 0o711  # jobs/<id>: the worker's
        # From a process of bob's user: alice's files are closed to it, its own are not.
        alices, bobs = _files_of(settings, 1), _files_of(settings, 2)
        jobs_dir = attempt_dir.parent.parent
        out = subprocess.run(
            ["runuser", "-u", bob_user, "--", rank_python.python, "-c", READER,
             *map(str, [*alices, *bobs, jobs_dir, attempt_dir.parent])],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        seen = json.loads(out.stdout)
        assert {str(f): "PermissionError" for f in alices} == {str(f): seen[str(f)] for f in alices}
        assert all(seen[str(f)] == "read" for f in bobs), seen
        assert seen[str(jobs_dir)] == seen[str(attempt_dir.parent)] == "PermissionError"
        for plan in plans.values():
            (Path(plan.log_dir) / "release").touch()
        for job_id, handle in handles.items():
            status = _wait_end(launcher, handle)
            assert status.phase == RunPhase.SUCCEEDED, (job_id, status)
    finally:
        for handle in handles.values():
            launcher.cancel(handle)
