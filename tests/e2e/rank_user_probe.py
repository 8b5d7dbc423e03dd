"""A hostile rank, for the DDPQ_RANK_USER tests: what can it reach of the worker's secrets?

Two ways in:

- as a user entrypoint (``task: tests.e2e.rank_user_probe:probe``, allowed through
  DDPQ_ALLOWED_ENTRYPOINTS), config ``{"db_path": <the SQLite file>}``;
- as the local launcher's per-rank program itself (``python rank_user_probe.py``, standing in
  for ``worker.runtime``), the database path in ``PROBE_DB_PATH``; it then writes rank 0's
  result.json as the runtime would.

Either way each rank writes ``user-probe-rank-<rank>.json`` into its attempt directory: its
uid, what opening the database file and its spec did, the ``DDPQ_*`` names in its
environment, and what reading its ancestors' ``/proc/<pid>/environ`` found. Standard library
only, so the script form runs without ddpq on the path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

SECRET_NAMES = (b"DDPQ_DATABASE_URL=", b"DDPQ_TOKEN=")


def try_open(path: str) -> str:
    """``"readable"`` when the first bytes of ``path`` can be read, else the error's name."""
    try:
        with open(path, "rb") as fh:
            fh.read(16)
    except OSError as exc:
        return type(exc).__name__
    return "readable"


def _ancestors() -> list[int]:
    pids, pid = [], os.getppid()
    while pid > 1 and len(pids) < 32:
        pids.append(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return pids


def _ancestor_secrets() -> dict[str, str]:
    """Each ancestor's pid → "secret" (its environ names the database URL or a user token),
    "clean", or the error that refused the read."""
    found: dict[str, str] = {}
    for pid in _ancestors():
        try:
            data = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError as exc:
            found[str(pid)] = type(exc).__name__
            continue
        leaked = any(e.startswith(SECRET_NAMES) for e in data.split(b"\0"))
        found[str(pid)] = "secret" if leaked else "clean"
    return found


def _attempt_dir() -> Path:
    return (
        Path(os.environ["DDPQ_ARTIFACT_DIR"]) / "jobs" / os.environ["DDPQ_JOB_ID"]
        / f"attempt-{os.environ['DDPQ_ATTEMPT']}"
    )  # fmt: skip


def observe(db_path: str) -> dict[str, Any]:
    """What this process can reach (see the module docstring)."""
    return {
        "uid": os.getuid(),
        "pid": os.getpid(),
        "home": os.environ.get("HOME"),
        "db": try_open(db_path),
        "spec": try_open(str(_attempt_dir() / "spec.json")),
        "ddpq_env": sorted(k for k in os.environ if k.startswith("DDPQ_")),
        "ancestors": _ancestor_secrets(),
    }


def _write(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def probe(ctx: Any) -> None:
    """The entrypoint: record what this rank reaches, then end (the job succeeds)."""
    report = observe(str(ctx.config["db_path"]))
    _write(_attempt_dir() / f"user-probe-rank-{ctx.rank}.json", report)


if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    _write(_attempt_dir() / f"user-probe-rank-{rank}.json", observe(os.environ["PROBE_DB_PATH"]))
    if rank == 0:
        _write(
            _attempt_dir() / "result.json",
            {"status": "succeeded", "step": 0, "final_metrics": {}, "checkpoint": None},
        )
