"""A hostile custom entrypoint, run with auth on as one owner (alice), tries to reach the
worker's secrets, the database and another owner's (bob's) job: every try is refused or
finds nothing, bob's job, events and metrics are byte-for-byte unchanged, and alice's job
succeeds with its own metrics.

The probe (tests/e2e/hostile_probe.py) records what each try found in its attempt directory.
Run as root (CI), the ranks run as ``DDPQ_RANK_USER``: root holds CAP_SYS_PTRACE, so a rank
of the worker's root user could read the non-dumpable worker's ``/proc/<pid>/environ`` and
open the 0600 SQLite file; the Unix boundary is what shuts those. Run as another user, the
ranks are that user (non-dumpable worker, allow-listed environment), and the SQLite file,
being that user's, is readable: the README's "Security model" says so, and the test records
it without asserting it.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from sqlalchemy import select

from service.core import artifacts
from service.core.config import Settings
from service.core.wire import API_PREFIX
from service.store.auth.tokens import create_token
from service.store.models import ApiToken, Checkpoint, Job, JobEvent, Metric
from tests.e2e.test_rank_user import RankPython, rank_python, rank_user  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("hostile_probe.py")
ALLOWED_RANK_ENV = {
    "DDPQ_JOB_ID", "DDPQ_ATTEMPT", "DDPQ_ARTIFACT_DIR", "DDPQ_API_URL", "DDPQ_ATTEMPT_TOKEN",
    "DDPQ_PG_TIMEOUT_S", "DDPQ_STOP_GRACE_S", "DDPQ_ALLOWED_ENTRYPOINTS",
    "DDPQ_CHECKPOINT_TRANSPORT", "DDPQ_CHECKPOINT_DIR",
}  # fmt: skip
REQUIRED_RANK_ENV = {"DDPQ_JOB_ID", "DDPQ_ATTEMPT", "DDPQ_ARTIFACT_DIR", "DDPQ_API_URL",
                     "DDPQ_ATTEMPT_TOKEN"}  # fmt: skip


@pytest.fixture
def ranks_as(request: pytest.FixtureRequest) -> RankPython | None:
    """As root: the interpreter and code the rank user runs (test_rank_user's set-up; skips
    when it cannot be made to work). Otherwise None: the ranks run as this user."""
    if os.geteuid() != 0:
        return None
    found: RankPython = request.getfixturevalue("rank_python")
    return found


@pytest.fixture(params=["sqlite", "postgresql"])
def base(request: pytest.FixtureRequest) -> Any:
    """The e2e deployment fixture of that database: its class, and on PostgreSQL its fresh
    schema (its own API, auth off, is stopped: the test runs its own)."""
    dep = request.getfixturevalue("deployment" if request.param == "sqlite" else "pg_deployment")
    dep.api.stop()
    return dep


def _auth_on(deployment: type[Any]) -> type[Any]:
    """The deployment class, waiting for /healthz (/readyz wants a caller once auth is on)."""

    class AuthOn(deployment):  # type: ignore[misc]
        def _ready(self) -> bool:
            if self.api.popen.poll() is not None:
                raise AssertionError(f"the API exited:\n{self.api.output()}")
            try:
                return httpx.get(self.url + "/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

    return AuthOn


def _rows(dep: Any, job_id: int) -> str:
    """Bob's raw rows (job, events, metrics, checkpoints) and every API token hash."""
    out = []
    with dep.db.session(write=False) as s:
        for model, where in ((Job, Job.id == job_id), (JobEvent, JobEvent.job_id == job_id),
                             (Metric, Metric.job_id == job_id),
                             (Checkpoint, Checkpoint.job_id == job_id)):  # fmt: skip
            table = model.__table__
            query = select(table).where(where).order_by(*table.primary_key.columns)
            out.append(repr([tuple(r) for r in s.execute(query).all()]))
        out.append(repr(sorted(s.scalars(select(ApiToken.token_hash)).all())))
    return "\n".join(out)


def _api(http: httpx.Client, job_id: int) -> dict[str, bytes]:
    paths = [f"/jobs/{job_id}", f"/jobs/{job_id}/events", f"/jobs/{job_id}/metrics",
             f"/jobs/{job_id}/metrics/names", f"/jobs/{job_id}/checkpoints"]  # fmt: skip
    answers = {}
    for path in paths:
        r = http.get(path)
        assert r.status_code == 200, f"{path}: {r.status_code} {r.text}"
        answers[path] = r.content
    return answers


def _wait_end(dep: Any, http: httpx.Client, job_id: int, timeout_s: float = 240) -> dict[str, Any]:
    def ended() -> dict[str, Any] | None:
        job: dict[str, Any] = http.get(f"/jobs/{job_id}").json()
        return job if job["state"] in ("succeeded", "failed", "cancelled") else None

    try:
        job: dict[str, Any] = dep.wait_for(ended, timeout_s, f"job {job_id} to end", 0.3)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{dep.diagnostics(job_id)}") from None
    return job


@pytest.mark.slow
def test_a_hostile_entrypoint_reaches_nothing(
    base: Any, shared_dir: Path, ranks_as: RankPython | None
) -> None:
    started = time.monotonic()
    on_sqlite = base.settings.resolved_database_url.startswith("sqlite")
    db_file = shared_dir / "ddpq.db"
    settings = Settings(
        home=shared_dir / ".ddpq",
        database_url=f"sqlite:///{db_file}" if on_sqlite else base.settings.database_url,
        artifact_dir=shared_dir / "artifacts",
        port=base.settings.port,
        heartbeat_interval_s=0.3,
        lease_s=15,
        auth="on",
        allowed_entrypoints=["examples.*:*", "tests.e2e.hostile_probe:*"],
        rank_user=None if ranks_as is None else "ddpq-rank-test",
    )
    dep = _auth_on(type(base))(settings, shared_dir)
    alice_id = 0
    try:
        with dep.db.session() as s:
            tokens = {o: create_token(s, owner=o)[1] for o in ("alice", "bob")}
        http = {
            o: httpx.Client(
                base_url=dep.url + API_PREFIX, timeout=30, headers={"Authorization": f"Bearer {t}"}
            )
            for o, t in tokens.items()
        }
        # The worker holds the database URL (settings_env) and a user token: bob's.
        dep.env["DDPQ_TOKEN"] = tokens["bob"]
        python = sys.executable
        if ranks_as is not None:
            python = ranks_as.python
            dep.env["PYTHONPATH"] = str(ranks_as.code)
            if ranks_as.code != REPO:
                shutil.copy2(PROBE, ranks_as.probe.with_name(PROBE.name))
                (ranks_as.probe.with_name(PROBE.name)).chmod(0o644)
        worker_argv = [python, "-m", "worker.main", "--slots", "1", "--gpus", "none"]
        dep._spawn("worker", worker_argv, dep.worker_env())

        bob_spec = dep.load_example(
            "regression", resources={"nproc_per_node": 1}, training={"max_steps": 6}
        )
        r = http["bob"].post("/jobs", json=bob_spec)
        assert r.status_code == 201, r.text
        bob_id = int(r.json()["id"])
        bob_job = _wait_end(dep, http["bob"], bob_id)
        assert bob_job["state"] == "succeeded", bob_job["error"]
        time.sleep(1)  # any trailing writes of bob's attempt land before the snapshot
        bob_api, bob_rows = _api(http["bob"], bob_id), _rows(dep, bob_id)
        assert b'"step":6' in bob_api[f"/jobs/{bob_id}/metrics"].replace(b" ", b""), bob_api

        pg: dict[str, str | None] = {"pg_dsn": None, "pg_dsn_as_owner": None}
        demands_password = False
        if not on_sqlite:  # the server's address, without the worker's credentials
            url = urlsplit(settings.resolved_database_url)
            where = f"{url.hostname}:{url.port or 5432}{url.path}"
            pg = {"pg_dsn": f"postgresql://{where}",
                  "pg_dsn_as_owner": f"postgresql://{url.username}@{where}"}  # fmt: skip
            demands_password = url.password is not None
        spec = {"name": "hostile", "task": "tests.e2e.hostile_probe:train",
                "config": {"victim_job_id": bob_id, "db_path": str(db_file) if on_sqlite else None,
                           **pg},
                "resources": {"nproc_per_node": 2, "timeout_min": 5}}  # fmt: skip
        r = http["alice"].post("/jobs", json=spec)
        assert r.status_code == 201, r.text
        alice_id = int(r.json()["id"])
        alice_job = _wait_end(dep, http["alice"], alice_id)
        assert alice_job["state"] == "succeeded", (
            f"{alice_job['error']}\n{dep.diagnostics(alice_id)}"
        )

        folder = artifacts.attempt_dir(settings.resolved_artifact_dir, alice_id, 1)
        found = [json.loads((folder / f"hostile-rank-{r}.json").read_text()) for r in (0, 1)]
        report = json.dumps(found, indent=1)
        print(report)  # what each try found, shown with -s or on failure
        for rank in found:
            if ranks_as is not None:
                assert rank["uid"] == pwd.getpwnam("ddpq-rank-test").pw_uid, report
            # (a) the environment: only the allow-listed DDPQ_* names, nothing secret-looking
            names = set(rank["env"]["ddpq_names"])
            assert REQUIRED_RANK_ENV <= names <= ALLOWED_RANK_ENV, report
            assert rank["env"]["suspicious"] == [], report
            # (b) no ancestor's environment names a secret
            ancestors = rank["ancestors"]
            assert "1" in ancestors, f"the walk reaches pid 1: {report}"
            leaked = {p: a for p, a in ancestors.items() if a["environ"] == "secret"}
            assert not leaked, f"an ancestor's environ holds a secret: {leaked}"
            # (c) the database
            db = rank["database"]
            if ranks_as is not None and on_sqlite:
                assert db["files"] and set(db["files"].values()) == {"PermissionError"}, report
                assert db["sqlite"].startswith("OperationalError"), report
            if not on_sqlite:  # with no password of its own; the URL's user only when the
                # server wants a password (a trust-auth server lets anyone in: its set-up)
                assert not db["pg_dsn"].startswith("connected"), report
                if demands_password:
                    assert not db["pg_dsn_as_owner"].startswith("connected"), report
        api = found[0]["api"]
        for call in ("GET /jobs", f"GET /jobs/{bob_id}", f"POST /jobs/{bob_id}/cancel",
                     "GET /workers", f"GET /jobs/{bob_id}/metrics", f"GET /jobs/{bob_id}/events",
                     "POST /jobs"):  # fmt: skip
            assert api[call] == 401, f"(d) {call} with the attempt token: {api[call]}"
        assert api["GET /tokens"] in (401, 404), api
        for call in ("metrics naming the victim", "metrics naming attempt 0",
                     "metrics naming attempt 2", "checkpoint naming the victim's file",
                     "deletion naming the victim"):  # fmt: skip
            assert api[call] == 422, f"(e) {call}: {api[call]}"
        # Its own attempt only (plus the filesystem store's id, how a rank tells whether it
        # shares the API's disk, and no init_from: this job starts from nothing).
        own = {k: api["self"][k] for k in ("job_id", "attempt", "state", "init_from")}
        assert own == {"job_id": alice_id, "attempt": 1, "state": "running", "init_from": None}
        assert set(api["self"]) == {*own, "store_id"}, api
        for forged in ("tampered suffix", "truncated", "as a user token"):
            for route in ("self", "metrics", "GET /jobs"):
                assert api[f"{forged}: {route}"] == 401, f"(f) {forged} on {route}: {api}"

        points = http["alice"].get(f"/jobs/{alice_id}/metrics").json()["points"]
        assert [p["step"] for p in points] == [1, 2, 3], points
        assert _api(http["bob"], bob_id) == bob_api, "bob's job as the API shows it changed"
        assert _rows(dep, bob_id) == bob_rows, "bob's rows (or the API tokens) changed"
        listed = [j["id"] for j in http["bob"].get("/jobs").json()["jobs"]]
        assert listed == [bob_id], f"bob lists only his own job: {listed}"
        print(f"hostile e2e: {time.monotonic() - started:.1f} s")
        for client in http.values():
            client.close()
    finally:
        dep.close()
    dep.wait_for(lambda: not dep.processes(alice_id), 30, "no process of alice's job left")
