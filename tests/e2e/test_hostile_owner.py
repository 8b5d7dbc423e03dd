"""Two owners on one host, auth on, users' code allowed: owner B's one hostile script runs
beside owner A's honest training script, and nothing B does reaches A or the service.

B's script (``bench/hostile_jobs/hostile.py``, a command job shipped as a workspace over
HTTP) in turn reads A's files on the host, fills its checkpoint quota, writes ~1 GB to its
stdout and stderr, reports 10^5 distinct metric names (10^6 costs the API ~50 s of CPU on
this kind of box, refusing each batch of 1,000: ``bench/hostile.py`` sends those), opens
files until EMFILE and forks until EAGAIN. A's script (``bench/hostile_jobs/honest.py``)
reports a loss every step and checkpoints every few steps meanwhile. Each owner's ranks run
as its own Unix user (``DDPQ_RANK_USERS``; the users are made with ``useradd``, as
``test_rank_user.py`` does), on one root-run local worker with 2 slots. The worker has an
artifact directory of its own (the worker host's disk), apart from the API's (the API host's
disk, where checkpoints arrive by upload): each side's disk use is measured on its own.

Every one of B's tries is refused or contained: A's files are closed to B's user; B's job has
a ``quota_exceeded`` event for its checkpoint bytes, its metric names and its log; its log
files hold at most the cap; its fd and fork bombs stop at the rlimits (B's user never holds
more tasks than ``DDPQ_RANK_NPROC_MAX``); B ends. A succeeds with every step's loss stored
exactly once and every checkpoint listed, and the API's artifact directory stays under the
sum of the quotas.
"""

from __future__ import annotations

import importlib.util
import json
import pwd
import shutil
import subprocess
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.client import DdpqClient
from service.core import artifacts
from service.core.config import Settings
from service.core.wire import API_PREFIX
from service.store.auth.tokens import create_token
from tests.e2e.test_hostile_entrypoint import _auth_on, base  # noqa: F401
from tests.e2e.test_rank_user import (  # noqa: F401
    OTHER_RANK_USER,
    RANK_USER,
    RankPython,
    _test_user,
    rank_python,
    rank_user,
)

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "bench" / "hostile_jobs"
MiB = 1 << 20
LOG_CAP_BYTES = MiB
NPROC_MAX = 200
NOFILE_MAX = 256
CHECKPOINT_JOB_MAX_BYTES = 4 * MiB
CHECKPOINT_OWNER_MAX_BYTES = 6 * MiB
WORKSPACE_OWNER_MAX_BYTES = MiB
METRIC_NAMES_PER_JOB = 100
METRIC_POINTS_PER_MINUTE = 60_000
QUOTA_SUM_BYTES = 2 * (CHECKPOINT_OWNER_MAX_BYTES + WORKSPACE_OWNER_MAX_BYTES)  # two owners
# A's run: at least A_STEPS steps, a checkpoint every A_EVERY, A_PAUSE_S seconds of pause per
# step; it goes on until the test drops RELEASE into its workspace, once B's job ended.
A_STEPS, A_EVERY, A_PAUSE_S = 20, 25, 0.1
RELEASE = "release"
B_LOG_BYTES = 1 << 30
B_NAMES = 100_000
B_CHECKPOINTS, B_CHECKPOINT_BYTES = 5, 3 * MiB // 2
SETTINGS_HIT = {"DDPQ_CHECKPOINT_JOB_MAX_BYTES", "DDPQ_METRIC_NAMES_PER_JOB",
                "DDPQ_RANK_LOG_MAX_BYTES"}  # fmt: skip
TERMINAL = ("succeeded", "failed", "cancelled")


class TaskCounter:
    """The most tasks (processes and threads) user ``uid`` held at once, sampled from /proc
    every ``every_s`` seconds in a thread until ``stop``."""

    def __init__(self, uid: int, every_s: float = 0.05) -> None:
        self.uid, self.every_s, self.most = uid, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _count(self) -> int:
        total = 0
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                lines = status.read_text().splitlines()
            except OSError:  # gone meanwhile
                continue
            fields = dict(line.split(":", 1) for line in lines if ":" in line)
            if int(fields.get("Uid", "-1 0").split()[0]) == self.uid:
                total += int(fields.get("Threads", "1"))
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.most = max(self.most, self._count())

    def stop(self) -> int:
        """Stop sampling; the most tasks seen."""
        self._stop.set()
        self._thread.join()
        return self.most


def _epoch_s(iso: str) -> float:
    """An API time (ISO 8601, UTC) as epoch seconds."""
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def du_bytes(path: Path) -> int:
    """Disk use of ``path`` in bytes (``du -sb``: apparent sizes, every file counted)."""
    done = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[0])


def workspace(root: Path, script: str) -> Path:
    """A directory holding only ``bench/hostile_jobs/<script>``: the owner's project."""
    root.mkdir()
    shutil.copy(JOBS / script, root / script)
    return root


def run_script(client: DdpqClient, work: Path, argv: list[str]) -> int:
    """Ship ``work`` and submit ``argv`` as a one-rank command job; its id."""
    job = client.run(argv, workdir=work, nproc_per_node=1, env={"OMP_NUM_THREADS": "1"},
                     overrides={"training.keep_checkpoints": 100})  # fmt: skip
    return int(job["id"])


def quota_settings(http: httpx.Client, job_id: int) -> dict[str, dict[str, Any]]:
    """The job's ``quota_exceeded`` events' data, by the setting each names."""
    events = http.get(f"/jobs/{job_id}/events").json()["events"]
    return {e["data"]["setting"]: e["data"] for e in events if e["kind"] == "quota_exceeded"}


@pytest.mark.slow
def test_a_hostile_owner_reaches_nothing_of_another_and_stays_within_its_quotas(
    base: Any,  # noqa: F811
    shared_dir: Path,
    rank_python: RankPython,  # noqa: F811
) -> None:
    started = time.monotonic()
    users = {"alice": _test_user(RANK_USER), "bob": _test_user(OTHER_RANK_USER)}
    on_sqlite = base.settings.resolved_database_url.startswith("sqlite")
    settings = Settings(
        home=shared_dir / ".ddpq",
        database_url=f"sqlite:///{shared_dir / 'ddpq.db'}" if on_sqlite
        else base.settings.database_url,
        artifact_dir=shared_dir / "api-artifacts", port=base.settings.port,
        heartbeat_interval_s=0.3, lease_s=15, auth="on", user_code="allow",
        rank_users=users, rank_log_max_bytes=LOG_CAP_BYTES, rank_nproc_max=NPROC_MAX,
        rank_nofile_max=NOFILE_MAX, checkpoint_job_max_bytes=CHECKPOINT_JOB_MAX_BYTES,
        checkpoint_owner_max_bytes=CHECKPOINT_OWNER_MAX_BYTES,
        workspace_owner_max_bytes=WORKSPACE_OWNER_MAX_BYTES,
        metric_names_per_job=METRIC_NAMES_PER_JOB,
        metric_points_per_minute=METRIC_POINTS_PER_MINUTE,
    )  # fmt: skip
    dep = _auth_on(type(base))(settings, shared_dir)
    host_dir = shared_dir / "host-artifacts"  # the worker host's disk
    ids: dict[str, int] = {}
    try:
        with dep.db.session() as s:
            tokens = {o: create_token(s, owner=o)[1] for o in users}
        http = {o: httpx.Client(base_url=dep.url + API_PREFIX, timeout=30,
                                headers={"Authorization": f"Bearer {t}"})
                for o, t in tokens.items()}  # fmt: skip
        clients = {o: DdpqClient(dep.url, t, timeout_s=30) for o, t in tokens.items()}
        worker_env = {**dep.worker_env(), "DDPQ_ARTIFACT_DIR": str(host_dir),
                      "PYTHONPATH": str(rank_python.code)}  # fmt: skip
        worker_argv = [rank_python.python, "-m", "worker.main", "--slots", "2", "--gpus", "none"]
        worker = dep._spawn("worker", worker_argv, worker_env)

        def diagnostics() -> str:
            return (
                "\n".join(dep.diagnostics(j) for j in ids.values())
                + "\n"
                + "\n".join(
                    f"--- {p}\n{p.read_text(errors='replace')[-3000:]}"
                    for p in sorted(host_dir.glob("jobs/*/attempt-*/*.log"))
                )
            )

        def wait(cond: Any, what: str, timeout_s: float = 120) -> Any:
            try:
                return dep.wait_for(cond, timeout_s, what, 0.2)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{diagnostics()}") from None

        ids["alice"] = run_script(
            clients["alice"], workspace(shared_dir / "alice", "honest.py"),
            ["honest.py", "--steps", str(A_STEPS), "--every", str(A_EVERY),
             "--pause-s", str(A_PAUSE_S), "--until", RELEASE],
        )  # fmt: skip
        a_id = ids["alice"]
        wait(lambda: http["alice"].get(f"/jobs/{a_id}/checkpoints").json()["checkpoints"],
             "A's first checkpoint")  # fmt: skip
        a_files = _victim_paths(host_dir, a_id)
        assert all(p.exists() for p in a_files), "A's files are there to be read"
        bob_uid = pwd.getpwnam(users["bob"]).pw_uid
        tasks = TaskCounter(bob_uid)
        ids["bob"] = run_script(
            clients["bob"], workspace(shared_dir / "bob", "hostile.py"),
            ["hostile.py", "--victim-job", str(a_id), "--victim-every", str(A_EVERY),
             "--checkpoints", str(B_CHECKPOINTS), "--checkpoint-bytes", str(B_CHECKPOINT_BYTES),
             "--log-bytes", str(B_LOG_BYTES), "--names", str(B_NAMES)],
        )  # fmt: skip
        b_id = ids["bob"]

        def ended(owner: str) -> dict[str, Any] | None:
            job: dict[str, Any] = http[owner].get(f"/jobs/{ids[owner]}").json()
            return job if job["state"] in TERMINAL else None

        b_job = wait(lambda: ended("bob"), "B's job to end", 300)
        most_tasks = tasks.stop()
        b_ran = time.monotonic() - started
        a_attempt = artifacts.attempt_dir(host_dir, a_id, 1)
        (artifacts.workspace_dir(host_dir, a_id, 1) / RELEASE).touch()
        a_job = wait(lambda: ended("alice"), "A's job to end", 120)
        # B's last attempt (a box loaded enough to let a lease lapse may have run a second).
        b_dir = artifacts.attempt_dir(host_dir, b_id, int(b_job["attempt"]))
        result = b_dir / "hostile-result.json"
        found = json.loads(result.read_text()) if result.exists() else {}
        print(f"B: attempt {b_job['attempt']}, {b_job['state']}", json.dumps(found, indent=1))
        assert worker.popen.poll() is None, "the worker survived"
        phases = {"read", "checkpoints_s", "log_s", "names_s", "files", "forks", "ended_at"}
        assert phases <= set(found), f"B stopped early: {b_job}\n{diagnostics()}"

        # B's reads of A's files: each refused.
        assert found["read"] == {str(p): "PermissionError" for p in a_files}, found["read"]
        # The fd and fork bombs stopped at the rlimits; B's user never held more tasks.
        assert found["files"]["stopped_by"] == "EMFILE", found
        assert found["files"]["opened"] < NOFILE_MAX, found
        assert found["forks"]["stopped_by"] == "EAGAIN", found
        assert 0 < found["forks"]["forked"] < NPROC_MAX, found
        assert most_tasks <= NPROC_MAX, f"B's user held {most_tasks} tasks"
        # B ended by itself, succeeded or failed with a named reason.
        assert b_job["state"] == "succeeded" or b_job["error"], b_job
        # Each quota B hit is an event on its job naming the setting to raise.
        hits = quota_settings(http["bob"], b_id)
        assert set(hits) >= SETTINGS_HIT, hits
        assert hits["DDPQ_CHECKPOINT_JOB_MAX_BYTES"]["limit"] == CHECKPOINT_JOB_MAX_BYTES
        assert hits["DDPQ_METRIC_NAMES_PER_JOB"]["limit"] == METRIC_NAMES_PER_JOB
        # B's logs hold at most the cap (plus the one marker line).
        b_logs = sorted(b_dir.glob("*.log"))
        assert b_logs and all(p.stat().st_size <= LOG_CAP_BYTES + 200 for p in b_logs), [
            (p.name, p.stat().st_size) for p in b_logs
        ]
        b_head = (b_dir / "rank-0.log").read_text("utf-8", "replace")
        assert "MB cut" in b_head and "DDPQ_RANK_LOG_MAX_BYTES" in b_head
        # B stored no more names than its quota.
        b_names = http["bob"].get(f"/jobs/{b_id}/metrics/names").json()["names"]
        assert len(b_names) <= METRIC_NAMES_PER_JOB, len(b_names)

        # A: ran beside B, succeeded, every step's loss once, every checkpoint listed.
        assert a_job["state"] == "succeeded", f"{a_job['error']}\n{diagnostics()}"
        a_log = (a_attempt / "rank-0.log").read_text("utf-8", "replace")
        a_steps = int(a_log.split("honest: ", 1)[1].split()[0])  # its own count of steps
        assert a_steps > A_EVERY, a_log[-2000:]
        points = (
            http["alice"]
            .get(f"/jobs/{a_id}/metrics", params={"name": "loss", "limit": 100_000})
            .json()["points"]
        )
        assert [p["step"] for p in points] == list(range(1, a_steps + 1))
        during_b = [p for p in points
                    if found["started_at"] <= _epoch_s(p["time"]) <= found["ended_at"]]  # fmt: skip
        assert len(during_b) > A_EVERY, "A trained while B's script was at work"
        listed = [c["step"] for c in http["alice"].get(f"/jobs/{a_id}/checkpoints")
                  .json()["checkpoints"]]  # fmt: skip
        assert sorted(listed) == list(range(A_EVERY, a_steps + 1, A_EVERY)), listed
        assert quota_settings(http["alice"], a_id) == {}, "A hit no quota"

        # The API host's disk: under the sum of the quotas, whatever B did.
        api_bytes = du_bytes(settings.resolved_artifact_dir)
        host_bytes = du_bytes(host_dir)
        print(f"hostile owner e2e: {time.monotonic() - started:.1f} s (B ended at "
              f"{b_ran:.1f} s; A made {a_steps} steps); API artifacts {api_bytes} bytes "
              f"(quotas {QUOTA_SUM_BYTES}), worker host {host_bytes} bytes; B's user's most "
              f"tasks {most_tasks}; B's job {b_job['started_at']} → "
              f"{b_job['finished_at']}")  # fmt: skip
        assert api_bytes < QUOTA_SUM_BYTES, (api_bytes, QUOTA_SUM_BYTES)
        for client in clients.values():
            client.close()
        for h in http.values():
            h.close()
    finally:
        dep.close()
    dep.wait_for(lambda: not any(dep.processes(j) for j in ids.values()), 30,
                 "no process of either job left")  # fmt: skip


def _victim_paths(host_dir: Path, a_id: int) -> list[Path]:
    """The paths of A's that B's script tries (its own ``victim_paths``)."""
    spec = importlib.util.spec_from_file_location("hostile_job", JOBS / "hostile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    paths: list[Path] = module.victim_paths(host_dir, a_id, A_EVERY)
    return paths
