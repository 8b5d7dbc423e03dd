"""Checkpoint faults with a real worker and real ranks: a corrupted newest checkpoint (truncated,
or same size with flipped bytes) is skipped on resume in favour of the previous one; a full disk
(a real tmpfs) fails checkpoint writes without touching the checkpoint already there."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from service.core import artifacts
from service.store.models import Metric
from worker.runtime.checkpoints.files import file_sha256

CHECKPOINT_EVERY_STEPS = 4


def rank_pids(dep: Any, job_id: int) -> list[int]:
    """The job's rank processes: forked by the agent's fork server, so each has its parent's
    command line (torchrun's agent, the fork server and multiprocessing's resource tracker
    were each started with a command line of their own)."""

    def cmdline_and_parent(pid: int) -> tuple[bytes, int] | None:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            return Path(f"/proc/{pid}/cmdline").read_bytes(), int(stat.rsplit(")", 1)[1].split()[1])
        except OSError:
            return None

    pids = set(dep.processes(job_id))
    ranks = []
    for pid in pids:
        me = cmdline_and_parent(pid)
        if me is not None and me[1] in pids:
            parent = cmdline_and_parent(me[1])
            if parent is not None and parent[0] == me[0]:
                ranks.append(pid)
    return sorted(ranks)


def loss_steps(dep: Any, job_id: int) -> list[int]:
    with dep.db.session(write=False) as s:
        rows = s.scalars(
            select(Metric.step).where(Metric.job_id == job_id, Metric.name == "loss")
        ).all()
    return sorted(rows)


def checkpoints(dep: Any, job_id: int) -> list[dict[str, Any]]:
    body: dict[str, Any] = dep.http.get(f"/jobs/{job_id}/checkpoints").json()
    return list(body["checkpoints"])


def corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:  # same size, different bytes: only the sha256 can tell
        for i in range(len(data) // 3, len(data) // 3 + 64):
            data[i] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.fixture(params=["truncate", "flip"])
def corruption(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.slow
def test_corrupt_newest_checkpoint_resumes_from_the_previous_one(
    deployment: Any, corruption: str
) -> None:
    dep = deployment
    dep.start_worker()
    spec = dep.load_example(
        "regression",
        config={"sleep_per_step_ms": 200},
        training={
            "epochs": 2,
            "checkpoint_every_steps": CHECKPOINT_EVERY_STEPS,
            "keep_checkpoints": 3,
        },
        max_restarts=1,
    )
    job_id = dep.submit(spec)
    dep.wait_state(job_id, ("running",), 120)

    def two_checkpoints_and_their_losses() -> bool:
        # Losses up to the newest checkpoint are in the database: whatever checkpoint ends up
        # "previous" after the kill, attempt 2 replays every step after it.
        ckpts = checkpoints(dep, job_id)
        steps = loss_steps(dep, job_id)
        return len(ckpts) >= 2 and bool(steps) and steps[-1] >= ckpts[0]["step"]

    dep.wait_for(two_checkpoints_and_their_losses, 120, "two checkpoints and their losses")
    ranks = rank_pids(dep, job_id)
    assert len(ranks) == spec["resources"]["nproc_per_node"], ranks
    for pid in ranks:  # a crash: no stop checkpoint, no goodbye flush
        # A rank gone already died with its peer (its agent tears the attempt down).
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    newest, previous = checkpoints(dep, job_id)[:2]
    assert loss_steps(dep, job_id)[-1] >= previous["step"]
    newest_path = artifacts.checkpoint_path(dep.artifact_dir, job_id, newest["step"])
    if not newest_path.exists():  # killed between its record and its rename into place
        newest_path.write_bytes(b"\0" * 4096)  # then damaged all the same: what resume sees
    corrupt(newest_path, corruption)

    job = dep.wait_state(job_id, ("succeeded",), 240)
    assert job["attempt"] == 2
    total = job["progress"]["total_steps"]
    assert loss_steps(dep, job_id) == list(range(1, total + 1)), "one loss per step"
    log = artifacts.rank_log_path(dep.artifact_dir, job_id, 2, 0).read_text(errors="replace")
    assert f"checkpoint step={newest['step']} at" in log and "fails its sha256" in log, log
    assert f"step-{previous['step']}.pt: step {previous['step']}," in log, (
        f"attempt 2 must resume from step {previous['step']}:\n{log}"
    )
    assert newest["step"] not in [c["step"] for c in checkpoints(dep, job_id)], (
        "the corrupt checkpoint must no longer be listed"
    )


# -- full disk ---------------------------------------------------------------------------------
# regression with hidden=20000: params + AdamW moments ≈ 3 × 1.3 MB ≈ 3.7 MiB per checkpoint.
# A 6 MiB tmpfs holds one checkpoint but not a second beside it.
BIG_HIDDEN = 20_000
DISK_BYTES = 6 << 20


@pytest.fixture
def small_checkpoint_disk(deployment: Any) -> Iterator[Path]:
    """A 6 MiB tmpfs mounted where job 1 (the first job of the deployment) keeps its
    checkpoints (mounting needs root: CI and the dev VM run tests as root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs the suite as root)")
    mnt = artifacts.checkpoint_dir(deployment.artifact_dir, 1)
    mnt.mkdir(parents=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(mnt)]
    done = subprocess.run(mount, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
def test_full_disk_warns_keeps_training_and_fails_on_the_final_checkpoint(
    deployment: Any, small_checkpoint_disk: Path
) -> None:
    dep = deployment
    dep.start_worker()
    spec = dep.load_example(
        "regression",
        config={"hidden": BIG_HIDDEN},
        training={"epochs": 1, "checkpoint_every_steps": CHECKPOINT_EVERY_STEPS},
    )
    job_id = dep.submit(spec)
    assert job_id == 1, "the tmpfs is mounted for job 1"
    job = dep.wait_state(job_id, ("failed",), 240)

    total = job["progress"]["total_steps"]
    assert total > 2 * CHECKPOINT_EVERY_STEPS
    assert "No space left on device" in (job["error"] or ""), job["error"]
    assert f"checkpoint at step {total}" in job["error"], job["error"]
    assert loss_steps(dep, job_id) == list(range(1, total + 1)), "training must go on"
    reasons = [e["reason"] or "" for e in dep.events(job_id)]
    warned = [r for r in reasons if r.startswith("checkpoint at step") and "No space" in r]
    assert warned, f"each failed periodic checkpoint must be a job event: {reasons}"
    [kept] = checkpoints(dep, job_id)
    assert kept["step"] == CHECKPOINT_EVERY_STEPS, "the first checkpoint is the one that fit"
    path = artifacts.checkpoint_path(dep.artifact_dir, job_id, kept["step"])
    assert file_sha256(path) == kept["sha256"], "the previous checkpoint must stay intact"
    assert sorted(p.name for p in small_checkpoint_disk.iterdir()) == [path.name], (
        "no temp file or half-written checkpoint may be left on the full disk"
    )
    log = artifacts.rank_log_path(dep.artifact_dir, job_id, 1, 0).read_text(errors="replace")
    assert "could not be written; the previous one is intact" in log, log
