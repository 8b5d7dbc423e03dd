"""Checkpoints recorded through the real attempt API (uvicorn on loopback) into real SQLite and
PostgreSQL: atomic write, sha256, rotation, strict load into the bare model, snapshot
isolation, corrupt newest skipped on resume, fencing, an API outage, and a full disk (a real
tmpfs of 2 MiB: ENOSPC from the kernel)."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from service.core import artifacts
from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.core.wire.attempt import MetricBatch, MetricBatchAck
from service.store.checkpoints.crud import list_checkpoints
from service.store.db import Database
from service.store.jobs.crud import Transition, apply_transition, list_events
from service.store.metrics.points import query_points
from service.store.models import Checkpoint
from tests.rank_api import LiveApi, attempt_client, live_api, mint_token, rank_environ, running_job
from worker.runtime.attempt_client import AttemptClient
from worker.runtime.checkpoints.fetch import find_resume_checkpoint
from worker.runtime.checkpoints.files import CheckpointWriteError, file_sha256, load_checkpoint_file
from worker.runtime.checkpoints.saver import Checkpointer, NullCheckpointer, make_checkpointer
from worker.runtime.metrics.buffer import Progress
from worker.runtime.metrics.sink import ApiSink
from worker.runtime.topology import RankEnv


@pytest.fixture
def api(db: Database, settings: Settings) -> Iterator[LiveApi]:
    with live_api(settings) as served:
        yield served


def client_for(db: Database, api: LiveApi, job: tuple[int, int]) -> AttemptClient:
    return attempt_client(db, api.url, *job)


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def state_of(model: nn.Module, step: int) -> dict[str, object]:
    return {"model": model.state_dict(), "step": step, "epoch": 0, "batch_idx": step}


@pytest.fixture
def job(db: Database) -> tuple[int, int]:
    return running_job(db)


@pytest.fixture
def job_keep1(db: Database) -> tuple[int, int]:
    """A running job whose spec keeps one checkpoint (the service rotates at each record)."""
    spec = JobSpec.model_validate(
        {"name": "t", "task": "regression", "training": {"keep_checkpoints": 1}}
    )
    return running_job(db, spec)


@pytest.fixture
def artifact_dir(settings: Settings) -> Path:
    return settings.resolved_artifact_dir


def live(db: Database, job_id: int) -> list[Checkpoint]:
    with db.session(write=False) as s:
        return list_checkpoints(s, job_id)


def test_make_checkpointer_picks_by_rank(
    db: Database, api: LiveApi, job: tuple[int, int], artifact_dir: Path
) -> None:
    environ = rank_environ(api.url, mint_token(db, *job), *job)
    chief = make_checkpointer(RankEnv.from_environ(environ), artifact_dir, keep=1)
    other_env = RankEnv.from_environ({**environ, "RANK": "1", "WORLD_SIZE": "2"})
    other = make_checkpointer(other_env, artifact_dir, keep=1)
    built: list[int] = []
    other.save(1, 0, lambda: built.append(1) or {})  # type: ignore[func-returns-value]
    assert isinstance(chief, Checkpointer)
    assert type(other) is NullCheckpointer
    assert built == [], "non-zero ranks must not even build the state"
    chief.close()


def test_write_is_atomic_recorded_rotated_and_loads_strictly(
    db: Database, api: LiveApi, artifact_dir: Path
) -> None:
    """Rotation is the service's (``training.keep_checkpoints``, here 2), at each record."""
    spec = JobSpec.model_validate(
        {"name": "t", "task": "regression", "training": {"keep_checkpoints": 2}}
    )
    job = running_job(db, spec)
    job_id, attempt = job
    model = tiny_model()
    ckpt = Checkpointer(client_for(db, api, job), artifact_dir, job_id, attempt, keep=2)
    for step in (1, 2, 3, 4):
        ckpt.save(step, 0, lambda s=step: state_of(model, s))  # type: ignore[misc]
    ckpt.close()

    kept = live(db, job_id)
    assert [c.step for c in kept] == [4, 3]
    ckpt_dir = artifacts.checkpoint_dir(artifact_dir, job_id)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step-3.pt", "step-4.pt"], (
        "rotation must delete old files and no temp file may be left behind"
    )
    for record in kept:
        path = Path(record.path)
        assert path == artifacts.checkpoint_path(artifact_dir, job_id, record.step)
        assert record.size_bytes == path.stat().st_size
        assert record.sha256 == file_sha256(path)
        assert record.attempt == attempt
    assert ckpt.last_saved is not None and ckpt.last_saved.step == 4

    state = load_checkpoint_file(
        artifacts.checkpoint_path(artifact_dir, job_id, 4), torch.device("cpu")
    )
    bare = tiny_model()
    bare.load_state_dict(state["model"], strict=True)  # keys without a "module." prefix
    for a, b in zip(bare.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_snapshot_is_taken_on_the_training_thread(
    db: Database, api: LiveApi, job: tuple[int, int], artifact_dir: Path
) -> None:
    job_id, attempt = job
    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    ckpt = Checkpointer(client_for(db, api, job), artifact_dir, job_id, attempt, keep=3)
    ckpt.save(7, 0, lambda: state_of(model, 7))
    with torch.no_grad():  # training goes on while the file is written
        for p in model.parameters():
            p.add_(100.0)
    ckpt.close()
    state = load_checkpoint_file(
        artifacts.checkpoint_path(artifact_dir, job_id, 7), torch.device("cpu")
    )
    restored = tiny_model()
    restored.load_state_dict(state["model"])
    for a, b in zip(restored.parameters(), before, strict=True):
        assert torch.equal(a, b), "the checkpoint must hold the values at save() time"


def test_corrupt_or_missing_newest_is_skipped_on_resume(
    db: Database, api: LiveApi, job: tuple[int, int], artifact_dir: Path
) -> None:
    job_id, attempt = job
    model = tiny_model()
    ckpt = Checkpointer(client_for(db, api, job), artifact_dir, job_id, attempt, keep=5)
    for step in (10, 20, 30):
        ckpt.save(step, 0, lambda s=step: state_of(model, s))  # type: ignore[misc]
    ckpt.close()
    newest = artifacts.checkpoint_path(artifact_dir, job_id, 30)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different bytes
    newest.write_bytes(bytes(data))
    artifacts.checkpoint_path(artifact_dir, job_id, 20).unlink()

    assert find_resume_checkpoint(client_for(db, api, job), artifact_dir, job_id) == 10
    assert [c.step for c in live(db, job_id)] == [10], "bad ones must be marked deleted"


def _held_sink(db: Database, api: LiveApi, job: tuple[int, int]) -> tuple[threading.Event, ApiSink]:
    """A rank-0 sink whose batches wait (up to 30 s) until the returned gate is set: the API
    slow to take the points."""
    gate = threading.Event()
    sink_client = client_for(db, api, job)
    send = sink_client.send_metrics

    def held_send(batch: MetricBatch) -> MetricBatchAck:
        gate.wait(30)
        return send(batch)

    sink_client.send_metrics = held_send  # type: ignore[method-assign]
    return gate, ApiSink(None, sink_client)


def test_a_slow_recorder_keeps_every_checkpoint_and_an_outage_only_the_newest_few(
    db: Database, api: LiveApi, job: tuple[int, int], artifact_dir: Path
) -> None:
    """Checkpoints written while the first one waits for its points (the API slow, a loaded
    box) are all kept once the points go through; only one with MAX_NEWER_WAITING newer ones
    behind it (an outage's backlog) is given up."""
    job_id, attempt = job
    gate, sink = _held_sink(db, api, job)
    ckpt = Checkpointer(
        client_for(db, api, job), artifact_dir, job_id, attempt, keep=10, points=sink
    )
    try:
        for step in range(1, 6):
            sink.report(step, 0, torch.tensor(float(step)))
        sink.flush(Progress(5, 10, 0, None, None))
        ckpt.save(5, 0, lambda: state_of(tiny_model(), 5))
        time.sleep(1.0)  # 5 is waiting for its points now
        ckpt.save(6, 0, lambda: state_of(tiny_model(), 6))
        ckpt.save(7, 0, lambda: state_of(tiny_model(), 7))
        gate.set()
        ckpt.wait()
        assert sorted(c.step for c in live(db, job_id)) == [5, 6, 7], "a slow API lost one"

        gate.clear()
        for step in range(8, 10):
            sink.report(step, 0, torch.tensor(float(step)))
        sink.flush(Progress(9, 10, 0, None, None))
        ckpt.save(9, 0, lambda: state_of(tiny_model(), 9))
        time.sleep(1.0)  # 9 waits; 10, 11 and 12 are written behind it
        for step in (10, 11, 12):
            ckpt.save(step, 0, lambda step=step: state_of(tiny_model(), step))  # type: ignore[misc]
        gate.set()
        ckpt.wait()
        kept = sorted(c.step for c in live(db, job_id) if c.step > 7)
        assert kept == [9, 11, 12], f"10 (two newer behind it) given up, no other: {kept}"
    finally:
        gate.set()
        ckpt.close()
        sink.close()


def test_a_checkpoint_counts_only_once_the_points_before_it_are_stored(
    db: Database, api: LiveApi, job: tuple[int, int], artifact_dir: Path
) -> None:
    """The next attempt resumes after the newest checkpoint's step, so the points reported up
    to it must be stored before it is recorded: else a rank killed right after the save
    leaves those steps without a point for good."""
    job_id, attempt = job
    gate, sink = _held_sink(db, api, job)
    ckpt = Checkpointer(
        client_for(db, api, job), artifact_dir, job_id, attempt, keep=2, points=sink
    )
    try:
        for step in range(1, 6):
            sink.report(step, 0, torch.tensor(float(step)))
        sink.flush(Progress(5, 10, 0, None, None))
        ckpt.save(5, 0, lambda: state_of(tiny_model(), 5))
        time.sleep(1.0)  # ample time to write and record a tiny checkpoint
        assert live(db, job_id) == [], "recorded before the points it covers were stored"
        # Training goes on meanwhile: the next save needs only the snapshot buffers back,
        # not the previous checkpoint's points (the gate holds those for 30 s).
        second = threading.Thread(target=ckpt.save, args=(6, 0, lambda: state_of(tiny_model(), 6)))
        second.start()
        second.join(20)
        assert not second.is_alive(), "a save waited for the previous checkpoint's points"
        assert live(db, job_id) == []
        gate.set()
        ckpt.wait()
        assert sorted(c.step for c in live(db, job_id)) == [5, 6]
        with db.session(write=False) as s:
            points, _ = query_points(s, job_id, "loss", limit=100)
        assert [p.step for p in points] == [1, 2, 3, 4, 5]
    finally:
        gate.set()
        ckpt.close()
        sink.close()


def test_nothing_to_resume_from(
    db: Database, api: LiveApi, job: tuple[int, int], artifact_dir: Path
) -> None:
    assert find_resume_checkpoint(client_for(db, api, job), artifact_dir, job[0]) is None


def test_stale_attempt_is_fenced_off(
    db: Database, api: LiveApi, job: tuple[int, int], artifact_dir: Path
) -> None:
    job_id, attempt = job
    model = tiny_model()
    with db.session() as s:
        apply_transition(s, Transition(job_id, JobState.RUNNING, JobState.CANCELLED))
    ckpt = Checkpointer(client_for(db, api, job), artifact_dir, job_id, attempt, keep=2)
    ckpt.save(5, 0, lambda: state_of(model, 5))
    ckpt.close()
    assert ckpt.should_stop()
    assert ckpt.last_saved is None
    assert live(db, job_id) == []
    ckpt_dir = artifacts.checkpoint_dir(artifact_dir, job_id)
    assert not any(ckpt_dir.iterdir()), "a fenced-off attempt must leave no file behind"


def test_api_outage_records_nothing_publishes_nothing_and_training_goes_on(
    db: Database, settings: Settings, job: tuple[int, int], artifact_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """As with a database outage before: the save is logged as not recorded, no file is
    published (an unrecorded file is no checkpoint), the rank keeps training, and the next
    save after the API is back is recorded as usual."""
    job_id, attempt = job
    model = tiny_model()
    api = LiveApi(settings)  # its port, not served yet
    try:
        ckpt = Checkpointer(client_for(db, api, job), artifact_dir, job_id, attempt, keep=2)
        with caplog.at_level(logging.ERROR, logger="worker.runtime.checkpoints.saver"):
            ckpt.save(1, 0, lambda: state_of(model, 1))
            ckpt.wait()
        assert "checkpoint at step 1 not recorded" in caplog.text
        assert not ckpt.should_stop() and ckpt.last_saved is None
        assert not artifacts.checkpoint_path(artifact_dir, job_id, 1).exists()
        api.start()
        ckpt.save(2, 0, lambda: state_of(model, 2))
        ckpt.close()
    finally:
        api.stop()
    assert [c.step for c in live(db, job_id)] == [2]
    ckpt_dir = artifacts.checkpoint_dir(artifact_dir, job_id)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step-2.pt"]


# -- full disk ---------------------------------------------------------------------------------
SMALL_DISK_BYTES = 2 << 20
# nn.Linear(400, 400) in float32: ~628 KiB of weights per checkpoint file.
DISK_MODEL_WIDTH = 400


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs (mounting needs root: CI and the dev VM run tests as root)."""
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a 2 MiB tmpfs needs root (CI runs the suite as root)")
    mount = ["mount", "-t", "tmpfs", "-o", f"size={SMALL_DISK_BYTES}", "tmpfs", str(mnt)]
    done = subprocess.run(mount, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def disk_api(db: Database, settings: Settings, small_disk: Path) -> Iterator[LiveApi]:
    """The attempt API with the small disk as its artifact root (it accepts checkpoint
    paths only under its own root)."""
    with live_api(settings.model_copy(update={"artifact_dir": small_disk})) as served:
        yield served


def fill_disk(disk: Path, leave_bytes: int) -> Path:
    """Write a filler file until only about ``leave_bytes`` bytes are free on ``disk``."""
    stat = os.statvfs(disk)
    free = stat.f_bavail * stat.f_frsize
    filler = disk / "filler"
    with open(filler, "wb") as fh:
        fh.write(b"\0" * max(free - leave_bytes, 0))
    return filler


def disk_state(model: nn.Module, step: int) -> dict[str, object]:
    return {"model": model.state_dict(), "step": step}


def test_full_disk_fails_the_write_keeps_the_previous_and_training_goes_on(
    db: Database, job_keep1: tuple[int, int], small_disk: Path, disk_api: LiveApi
) -> None:
    job = job_keep1
    job_id, attempt = job
    torch.manual_seed(0)
    model = nn.Linear(DISK_MODEL_WIDTH, DISK_MODEL_WIDTH)
    ckpt = Checkpointer(client_for(db, disk_api, job), small_disk, job_id, attempt, keep=1)
    ckpt.save(1, 0, lambda: disk_state(model, 1))
    ckpt.wait()
    first = artifacts.checkpoint_path(small_disk, job_id, 1)
    first_bytes = first.read_bytes()
    filler = fill_disk(small_disk, leave_bytes=len(first_bytes) // 3)

    with torch.no_grad():
        model.weight.add_(1.0)
    ckpt.save(2, 0, lambda: disk_state(model, 2))  # runs out of space half-way
    ckpt.wait()

    assert ckpt.failed and ckpt.failed[-1][0] == 2, "the failed write must be noted"
    assert "No space left on device" in ckpt.failed[-1][1], ckpt.failed
    assert not ckpt.should_stop(), "a failed periodic checkpoint must not stop training"
    assert first.read_bytes() == first_bytes, "the previous checkpoint must stay intact"
    [record] = live(db, job_id)
    assert (record.step, record.sha256) == (1, file_sha256(first))
    assert sorted(p.name for p in first.parent.iterdir()) == ["step-1.pt"], (
        "no half-written checkpoint may be published and no temp file may be left"
    )
    assert find_resume_checkpoint(client_for(db, disk_api, job), small_disk, job_id) == 1
    with db.session(write=False) as s:
        reasons = [e.reason or "" for e in list_events(s, job_id)]
    assert any("step 2" in r and "No space left on device" in r for r in reasons), reasons

    filler.unlink()  # space comes back: the next checkpoint is written as usual
    ckpt.save(3, 0, lambda: disk_state(model, 3))
    ckpt.close()  # the newest checkpoint was written: no error
    assert [c.step for c in live(db, job_id)] == [3]
    state = load_checkpoint_file(
        artifacts.checkpoint_path(small_disk, job_id, 3), torch.device("cpu")
    )
    assert torch.equal(state["model"]["weight"], model.weight)


def test_a_final_checkpoint_on_a_full_disk_is_reported_by_close(
    db: Database, job_keep1: tuple[int, int], small_disk: Path, disk_api: LiveApi
) -> None:
    job = job_keep1
    job_id, attempt = job
    model = nn.Linear(DISK_MODEL_WIDTH, DISK_MODEL_WIDTH)
    fill_disk(small_disk, leave_bytes=64 << 10)
    ckpt = Checkpointer(client_for(db, disk_api, job), small_disk, job_id, attempt, keep=1)
    ckpt.save(5, 0, lambda: disk_state(model, 5))
    with pytest.raises(CheckpointWriteError, match=r"step 5 .*No space left on device"):
        ckpt.close()
    assert live(db, job_id) == []
    assert not any(artifacts.checkpoint_dir(small_disk, job_id).iterdir())
