"""Your own script with ddpq's optional lines (``examples/tutorial/train_ddpq.py``) as a
command job: a real API, a real worker and 2 real torchrun ranks (gloo on CPU).

- ``ddpq.report`` gives the job its loss curve (every step once), ``ddpq.save_checkpoint``
  its checkpoints (listed with sha256), ``ddpq.config`` the spec's config;
- a cancel reaches the script through ``ddpq.should_stop``: the job ends ``cancelled`` within
  the stop grace, with a stop checkpoint at the step it stopped;
- a worker shutdown requeues the job; attempt 2 resumes from the newest checkpoint with
  ``ddpq.load_checkpoint`` and every step's loss is stored once.
"""

from __future__ import annotations

import hashlib
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "tutorial" / "train_ddpq.py"
STEPS_PER_EPOCH = 16  # 2,048 samples / 2 ranks / batches of 64


def project(tmp_path: Path) -> Path:
    work = tmp_path / "project"
    work.mkdir()
    shutil.copy(SCRIPT, work / "train_ddpq.py")
    return work


def submit(dep: Any, work: Path, *args: str, **overrides: Any) -> int:
    from service.client import DdpqClient

    with DdpqClient(dep.url) as client:
        job = client.run(["train_ddpq.py", *args], workdir=work, nproc_per_node=2,
                         overrides=overrides)  # fmt: skip
    return int(job["id"])


def loss_points(dep: Any, job_id: int) -> list[dict[str, Any]]:
    r = dep.http.get(f"/jobs/{job_id}/metrics", params={"name": "loss", "limit": 10000})
    assert r.status_code == 200, r.text
    points: list[dict[str, Any]] = r.json()["points"]
    return points


def rank_log(dep: Any, job_id: int, attempt: int = 1, rank: int = 0) -> str:
    path = dep.artifact_dir / "jobs" / str(job_id) / f"attempt-{attempt}" / f"rank-{rank}.log"
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.mark.slow
def test_report_checkpoints_and_config_reach_the_job(deployment: Any, tmp_path: Path) -> None:
    dep = deployment
    dep.start_worker()
    job_id = submit(dep, project(tmp_path), "--epochs", "3", **{"config": {"lr": 0.02}})
    job = dep.wait_state(job_id, ("succeeded",), 300)
    steps = [p["step"] for p in loss_points(dep, job_id)]
    assert steps == list(range(1, 3 * STEPS_PER_EPOCH + 1)), dep.diagnostics(job_id)
    assert job["latest_metrics"].get("loss") is not None
    assert job["progress"]["step"] == 3 * STEPS_PER_EPOCH
    saved = dep.checkpoints(job_id)
    assert [c["step"] for c in saved] == [48, 32, 16], saved
    r = dep.http.get(f"/jobs/{job_id}/checkpoints/48/file")
    assert r.status_code == 200
    assert hashlib.sha256(r.content).hexdigest() == saved[0]["sha256"]
    log = rank_log(dep, job_id)
    assert "lr 0.02;" in log, "ddpq.config() gives the spec's config over the defaults"
    assert f"job_id={job_id}, attempt=1, rank=0, local_rank=0, world_size=2" in log, log[-2000:]
    assert "Exception ignored" not in log, "nothing of ddpq's complains at the script's exit"


@pytest.mark.slow
def test_a_cancel_stops_the_script_with_a_stop_checkpoint(deployment: Any, tmp_path: Path) -> None:
    dep = deployment
    dep.start_worker()
    job_id = submit(dep, project(tmp_path), "--epochs", "40", "--epoch-sleep", "0.5")
    dep.wait_state(job_id, ("running",), 180)
    dep.wait_for(lambda: len(loss_points(dep, job_id)) >= STEPS_PER_EPOCH, 180, "an epoch")
    r = dep.http.post(f"/jobs/{job_id}/cancel")
    assert r.status_code == 202, r.text
    t0 = time.monotonic()
    job = dep.wait_state(job_id, ("cancelled",), 60)
    took = time.monotonic() - t0
    assert dep.processes(job_id) == [], "no rank outlives the cancel"
    last = max(p["step"] for p in loss_points(dep, job_id))
    assert last < 40 * STEPS_PER_EPOCH, "stopped early"
    newest = dep.checkpoints(job_id)[0]
    assert newest["step"] == last, (
        f"the stop checkpoint is at the step the script stopped ({last}), not {newest}; "
        f"{took:.1f} s\n{dep.diagnostics(job_id)}"
    )
    assert job["error"] is None or "cancel" in str(job["error"]).lower(), job["error"]


@pytest.mark.slow
def test_a_requeued_script_resumes_from_its_newest_checkpoint(
    deployment: Any, tmp_path: Path
) -> None:
    dep = deployment
    worker = dep.start_worker()
    epochs = 8
    job_id = submit(dep, project(tmp_path), "--epochs", str(epochs), "--epoch-sleep", "0.7")
    dep.wait_state(job_id, ("running",), 180)
    dep.wait_for(lambda: len(dep.checkpoints(job_id)) >= 2, 180, "two checkpoints")
    worker.signal(signal.SIGTERM)  # the worker's shutdown: its job goes back to the queue
    assert worker.popen.wait(120) == 0, worker.output()
    job = dep.job(job_id)
    assert (job["state"], job["attempt"]) == ("queued", 2), job
    newest = dep.checkpoints(job_id)[0]["step"]
    dep.start_worker()
    job = dep.wait_state(job_id, ("succeeded",), 300)
    assert job["attempt"] == 2
    log2 = rank_log(dep, job_id, attempt=2)
    assert f"(step {newest})" in log2, f"attempt 2 resumes at step {newest}:\n{log2[-3000:]}"
    steps = [p["step"] for p in loss_points(dep, job_id)]
    assert steps == list(range(1, epochs * STEPS_PER_EPOCH + 1)), (
        f"every step's loss once across the attempts\n{dep.diagnostics(job_id)}"
    )


def test_a_failing_script_that_uses_ddpq_is_blamed_for_its_own_error(
    deployment: Any, tmp_path: Path
) -> None:
    """ddpq's stop handling lives as long as the script: nothing of it may print a traceback
    at the interpreter's exit, where it would stand in for the script's own error."""
    dep = deployment
    dep.start_worker()
    work = tmp_path / "failing"
    work.mkdir()
    (work / "fail.py").write_text(
        "import ddpq\nddpq.report(1, loss=1.0)\nraise KeyError('real-problem')\n"
    )
    from service.client import DdpqClient

    with DdpqClient(dep.url) as client:
        job_id = int(client.run(["fail.py"], workdir=work, nproc_per_node=1)["id"])
    job = dep.wait_state(job_id, ("failed",), 180)
    assert job["error"].startswith("rank 0 failed: KeyError: 'real-problem'"), job["error"]
    log = rank_log(dep, job_id)
    assert "Exception ignored" not in log, log[-2000:]
    assert loss_points(dep, job_id)[0]["step"] == 1, "what it reported before failing is kept"
