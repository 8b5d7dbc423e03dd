"""A hostile custom entrypoint (``task: tests.e2e.hostile_probe:train``): one owner's training
code that tries to reach the worker's secrets, the database and other owners' jobs, and
records what each try found in ``hostile-rank-<rank>.json`` in its attempt directory (the
test, tests/e2e/test_hostile_entrypoint.py, reads it and asserts every try was refused).

Config: ``victim_job_id`` (another owner's job), ``db_path`` (the SQLite file, as an attacker
who read the docs would guess it; ``null`` on PostgreSQL), ``pg_dsn`` / ``pg_dsn_as_owner``
(the PostgreSQL server's address and database, with no user / with the URL's user but no
password; ``null`` on SQLite). Every rank probes its environment, its ancestors and the
database; rank 0 also calls the API with its attempt token. It reports ``loss`` at steps 1..3
like any job, so the test can see the job's own metrics arrive.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import torch

from tests.e2e.rank_user_probe import try_open

SECRET_NAMES = ("DDPQ_DATABASE_URL", "DDPQ_TOKEN")
# What a database URL or a user API token looks like (an attempt token starts ``ddpqa_``).
DB_URL = re.compile(r"^(sqlite|postgres(ql)?)(\+\w+)?://|\.db$", re.IGNORECASE)
API_TOKEN = re.compile(r"^ddpq_(?!a_)")


def _attempt_dir() -> Path:
    return (
        Path(os.environ["DDPQ_ARTIFACT_DIR"]) / "jobs" / os.environ["DDPQ_JOB_ID"]
        / f"attempt-{os.environ['DDPQ_ATTEMPT']}"
    )  # fmt: skip


def own_environment() -> dict[str, Any]:
    """(a) The ``DDPQ_*`` names in this process's environment, and any value of any variable
    that looks like a database URL or a user API token."""
    suspicious = sorted(
        name for name, value in os.environ.items()
        if DB_URL.search(value) or API_TOKEN.match(value)
    )  # fmt: skip
    return {"ddpq_names": sorted(k for k in os.environ if k.startswith("DDPQ_")),
            "suspicious": suspicious}  # fmt: skip


def _ancestors() -> list[int]:
    pids, pid = [], os.getppid()
    while pid >= 1 and len(pids) < 64:
        pids.append(pid)
        if pid == 1:
            break
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return pids


def ancestors_environ() -> dict[str, dict[str, Any]]:
    """(b) Each ancestor up to pid 1: its command, and what reading its environ gave
    ("secret" naming which, "clean", or the error)."""
    found: dict[str, dict[str, Any]] = {}
    for pid in _ancestors():
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            comm = "?"
        try:
            entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError as exc:
            found[str(pid)] = {"comm": comm, "environ": type(exc).__name__}
            continue
        names = [
            e.split(b"=", 1)[0].decode(errors="replace") for e in entries
            if e.split(b"=", 1)[0].decode(errors="replace") in SECRET_NAMES
            or DB_URL.search(e.split(b"=", 1)[-1].decode(errors="replace"))
            or API_TOKEN.match(e.split(b"=", 1)[-1].decode(errors="replace"))
        ]  # fmt: skip
        found[str(pid)] = {"comm": comm, "environ": "secret" if names else "clean",
                           "names": names}  # fmt: skip
    return found


def _sqlite_tokens(path: Path) -> str:
    """Open ``path`` as SQLite and count ``api_tokens``: the count, or the error's name."""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1)
        try:
            return f"read {conn.execute('SELECT count(*) FROM api_tokens').fetchone()[0]} tokens"
        finally:
            conn.close()
    except sqlite3.Error as exc:
        return f"{type(exc).__name__}: {exc}"


def _pg_connect(dsn: str) -> str:
    try:
        import psycopg

        with psycopg.connect(dsn, connect_timeout=3) as conn:
            return f"connected: {conn.execute('SELECT count(*) FROM api_tokens').fetchone()}"
    except Exception as exc:  # what it was is the record
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def database(config: dict[str, Any]) -> dict[str, Any]:
    """(c) The SQLite file at the given and at the guessed places (next to the artifact dir,
    under a ``.ddpq`` home, under ``$HOME``, in the working directory), and PostgreSQL."""
    artifacts = Path(os.environ["DDPQ_ARTIFACT_DIR"])
    guesses = [artifacts.parent / "ddpq.db", artifacts.parent / ".ddpq" / "ddpq.db",
               Path(os.environ.get("HOME", "/")) / ".ddpq" / "ddpq.db",
               Path.cwd() / "ddpq.db", Path.cwd() / ".ddpq" / "ddpq.db"]  # fmt: skip
    if config.get("db_path"):
        guesses.insert(0, Path(config["db_path"]))
    with_journals = [Path(f"{p}{end}") for p in guesses for end in ("", "-wal", "-shm")]
    files = {str(p): try_open(str(p)) for p in dict.fromkeys(with_journals) if p.exists()}
    found: dict[str, Any] = {"files": files}
    if config.get("db_path"):
        found["sqlite"] = _sqlite_tokens(Path(config["db_path"]))
    for key in ("pg_dsn", "pg_dsn_as_owner"):  # as its own user; as the URL's, no password
        if config.get(key):
            found[key] = _pg_connect(config[key])
    return found


def api_attacks(victim: int) -> dict[str, Any]:
    """(d)-(f) The attempt token against user routes, forged bodies, a tampered token."""
    token = os.environ["DDPQ_ATTEMPT_TOKEN"]
    base = os.environ["DDPQ_API_URL"].rstrip("/") + "/api/v1"
    row = [["loss", 1000, 0, 666.0, 1.7e9]]
    out: dict[str, Any] = {}
    with httpx.Client(base_url=base, timeout=30,
                      headers={"Authorization": f"Bearer {token}"}) as http:  # fmt: skip
        for method, path in (
            ("GET", "/jobs"), ("GET", f"/jobs/{victim}"), ("POST", f"/jobs/{victim}/cancel"),
            ("GET", "/workers"), ("GET", f"/jobs/{victim}/metrics"),
            ("GET", f"/jobs/{victim}/events"), ("GET", "/tokens"),
            ("POST", "/jobs"),
        ):  # fmt: skip
            body = (
                {"name": "x", "task": "regression"}
                if path == "/jobs" and method == "POST"
                else None
            )
            out[f"{method} {path}"] = http.request(method, path, json=body).status_code
        out["metrics naming the victim"] = http.post(
            "/attempts/self/metrics", json={"job_id": victim, "points": row}
        ).status_code
        out["metrics naming attempt 0"] = http.post(
            "/attempts/self/metrics", json={"attempt": 0, "points": row}
        ).status_code
        out["metrics naming attempt 2"] = http.post(
            "/attempts/self/metrics", json={"attempt": 2, "points": row}
        ).status_code
        out["checkpoint naming the victim's file"] = http.post(
            "/attempts/self/checkpoints",
            json={"step": 1, "epoch": 0, "size_bytes": 1, "sha256": "ab" * 32,
                  "path": str(Path(os.environ["DDPQ_ARTIFACT_DIR"]) / "jobs" / str(victim)
                              / "checkpoints" / "step-1.pt")},
        ).status_code  # fmt: skip
        out["deletion naming the victim"] = http.post(
            "/attempts/self/checkpoints/deletions", json={"job_id": victim, "steps": [1]}
        ).status_code
        out["self"] = http.get("/attempts/self").json()
        for name, forged in (
            ("tampered suffix", token[:-1] + ("A" if token[-1] != "A" else "B")),
            ("truncated", token[:-4]),
            ("as a user token", "ddpq_" + token.removeprefix("ddpqa_")),
        ):
            auth = {"Authorization": f"Bearer {forged}"}
            out[f"{name}: self"] = http.get("/attempts/self", headers=auth).status_code
            out[f"{name}: metrics"] = http.post(
                "/attempts/self/metrics", json={"points": row}, headers=auth
            ).status_code
            out[f"{name}: GET /jobs"] = http.get("/jobs", headers=auth).status_code
    return out


def train(ctx: Any) -> dict[str, float]:
    for step in range(1, 4):
        ctx.report(step, 0, loss=torch.tensor(0.5 / step))
    ctx.sink.flush()  # a collective: every rank calls it
    found: dict[str, Any] = {
        "uid": os.getuid(),
        "env": own_environment(),
        "ancestors": ancestors_environ(),
        "database": database(dict(ctx.config)),
    }
    if ctx.rank == 0:
        found["api"] = api_attacks(int(ctx.config["victim_job_id"]))
    tmp = _attempt_dir() / f".hostile-rank-{ctx.rank}.json.tmp"
    tmp.write_text(json.dumps(found, indent=1))
    os.replace(tmp, _attempt_dir() / f"hostile-rank-{ctx.rank}.json")
    return {"probed": 1.0}
