"""Sweeps over command jobs end to end (a real API, a real local worker, real torchrun
ranks): a user's script that prints what it was given, swept over ``env.LR`` and over a
command item by index (``command.2``), ``max_concurrent: 2``. Every trial is an ordinary
command job: its own value in its rank-0 log, all succeed, never more than 2 at once."""

from __future__ import annotations

import textwrap
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from service.client import DdpqClient
from service.workspaces.pack import pack_workspace

TERMINAL = ("succeeded", "failed", "cancelled")
SCRIPT = textwrap.dedent(
    """\
    import os
    import sys
    import time

    print(f"rank {os.environ['RANK']} LR={os.environ['LR']} argv={sys.argv[1:]}", flush=True)
    time.sleep(float(os.environ["HOLD_S"]))  # long enough for trials to overlap
    """
)


def rank0_log(dep: Any, job_id: int) -> str:
    path = dep.artifact_dir / "jobs" / str(job_id) / "attempt-1" / "rank-0.log"
    return str(path.read_text(errors="replace")) if path.exists() else ""


def run_sweep(dep: Any, body: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    r = dep.http.post("/sweeps", json=body)
    assert r.status_code == 201, r.text
    sweep_id = r.json()["id"]

    def ended() -> dict[str, Any] | None:
        got: dict[str, Any] = dep.http.get(f"/sweeps/{sweep_id}").json()
        return got if got["state"] in TERMINAL else None

    try:
        sweep = dep.wait_for(ended, 400, f"sweep {sweep_id} to end", every_s=1.0)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{dep.diagnostics(0)}") from None
    trials: list[dict[str, Any]] = dep.http.get(f"/sweeps/{sweep_id}/trials").json()["trials"]
    return sweep, trials


def max_overlap(dep: Any, job_ids: list[int]) -> int:
    """Most of these jobs starting or running at one instant (from their events)."""
    marks: list[tuple[datetime, int]] = []
    for job_id in job_ids:
        events = dep.events(job_id)
        start = next(e["created_at"] for e in events if e["to_state"] == "starting")
        end = next(e["created_at"] for e in events if e["to_state"] in TERMINAL)
        marks += [(datetime.fromisoformat(start), 1), (datetime.fromisoformat(end), -1)]
    open_now = most = 0
    for _, delta in sorted(marks, key=lambda m: (m[0], m[1])):
        open_now += delta
        most = max(most, open_now)
    return most


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sweeps_over_env_and_a_command_item_run_as_ordinary_command_trials(
    deployment: Any, tmp_path: Path
) -> None:
    dep = deployment
    work = tmp_path / "project"
    work.mkdir()
    (work / "show_lr.py").write_text(SCRIPT)
    packed = pack_workspace(work, max_bytes=2**20, max_files=10)
    uploaded = DdpqClient(dep.url, token="").upload_workspace(packed)
    dep.start_worker(slots=3)  # room for 3: only max_concurrent holds them to 2
    base = {
        "name": "lr",
        "command": ["show_lr.py", "--tag", "base"],
        "workspace": uploaded.digest,
        "env": {"LR": "1.0", "HOLD_S": "3"},
        "resources": {"nproc_per_node": 1, "timeout_min": 5},
    }

    lrs = [0.1, 0.01, 0.001]
    axes: dict[str, Any] = {"env.LR": {"grid": lrs}}
    sweep, trials = run_sweep(
        dep, {"name": "lr-sweep", "base": base, "axes": axes, "max_concurrent": 2}
    )
    ids = [t["job_id"] for t in trials]
    assert sweep["state"] == "succeeded", (sweep, dep.diagnostics(ids[0]))
    # A number for an env value or a command item is kept as its text (what the script
    # sees); every trial also carries the sweep's training.seed (unused by a command job).
    assert [t["overrides"] for t in trials] == [
        {"env.LR": str(lr), "training.seed": 0} for lr in lrs
    ]
    for lr, t in zip(lrs, trials, strict=True):
        job = dep.job(t["job_id"])
        assert job["state"] == "succeeded" and t["outcome"] == "succeeded", dep.diagnostics(
            t["job_id"]
        )
        assert job["spec"]["env"] == {"LR": str(lr), "HOLD_S": "3"}
        assert job["spec"]["command"] == base["command"]
        log = rank0_log(dep, t["job_id"])
        assert f"rank 0 LR={lr} argv=['--tag', 'base']" in log, log[-2000:]
    # 3 slots, 3 trials each held 3 s: only max_concurrent keeps the third one waiting.
    assert max_overlap(dep, ids) == 2

    tags = ["alpha", "beta"]
    axes = {"command.2": {"grid": tags}}
    sweep, trials = run_sweep(
        dep, {"name": "tag-sweep", "base": base, "axes": axes, "max_concurrent": 2}
    )
    assert sweep["state"] == "succeeded", (sweep, dep.diagnostics(trials[0]["job_id"]))
    assert [t["overrides"] for t in trials] == [
        {"command.2": tag, "training.seed": 0} for tag in tags
    ]
    for tag, t in zip(tags, trials, strict=True):
        job = dep.job(t["job_id"])
        assert job["state"] == "succeeded", dep.diagnostics(t["job_id"])
        assert job["spec"]["command"] == ["show_lr.py", "--tag", tag]
        log = rank0_log(dep, t["job_id"])
        assert f"rank 0 LR=1.0 argv=['--tag', '{tag}']" in log, log[-2000:]
