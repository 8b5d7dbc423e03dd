"""The metrics sink on real SQLite and PostgreSQL: cheap reports, batched writes, duplicates
ignored, a backlog (then a spill file) while the writer is blocked, fencing on a stale attempt.
Database outages: test_runtime_sink_outage.py."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sqlalchemy import select

from service.core.artifacts import metrics_spill_path
from service.core.spec import JobSpec
from service.core.states import JobState
from service.store.claims import claim_next_job
from service.store.db import Database
from service.store.jobs import Transition, apply_transition, get_job, submit_job
from service.store.metrics import query_points
from service.store.models import Job
from service.store.workers import register_worker
from worker.runtime.backlog import decode_point
from worker.runtime.sink import DatabaseSink, make_sink
from worker.runtime.sink_buffer import FLUSH_EVERY_POINTS, NullSink, Progress


def running_job(db: Database) -> tuple[int, int]:
    """A job claimed by a worker and marked running: ``(job_id, attempt)``."""
    with db.session() as s:
        register_worker(s, worker_id="w1", host="h", pid=1, launcher="local", capacity={"slots": 1})
        submit_job(s, JobSpec(name="t", task="regression"), owner="o")
    with db.session() as s:
        job = claim_next_job(s, worker_id="w1", launcher="local", max_gpus_per_node=0, lease_s=600)
        assert job is not None
        job_id, attempt = job.id, job.attempt
    with db.session() as s:
        apply_transition(s, Transition(job_id, JobState.STARTING, JobState.RUNNING))
    return job_id, attempt


@pytest.fixture
def job(db: Database) -> tuple[int, int]:
    return running_job(db)


@pytest.fixture
def sink(db: Database, job: tuple[int, int]) -> Iterator[DatabaseSink]:
    s = DatabaseSink(None, db, *job)
    yield s
    s.close()


def loss_values(db: Database, job_id: int, name: str = "loss") -> dict[int, float | None]:
    with db.session(write=False) as s:
        points, _ = query_points(s, job_id, name, limit=100_000)
        return {p.step: p.value for p in points}


def test_make_sink_picks_by_rank(db: Database, job: tuple[int, int], tmp_path: Path) -> None:
    chief = make_sink(0, None, db, *job, artifact_dir=tmp_path)
    other = make_sink(1, None, db, *job, artifact_dir=tmp_path)
    try:
        assert isinstance(chief, DatabaseSink)
        assert isinstance(other, NullSink)
        assert chief.spill_path == metrics_spill_path(tmp_path, *job)
    finally:
        chief.close()


def test_report_is_cheap_and_writes_nothing_until_flush(
    db: Database, job: tuple[int, int], sink: DatabaseSink
) -> None:
    losses = [torch.tensor(float(i)) for i in range(10_000)]
    start = time.perf_counter()
    for step, loss in enumerate(losses, start=1):
        sink.report(step, 0, loss)
    per_call_s = (time.perf_counter() - start) / len(losses)
    # Measured ~2 µs; a generous bound that still catches a per-call commit or host sync.
    assert per_call_s < 100e-6, f"report() took {per_call_s * 1e6:.1f} µs per call"
    assert loss_values(db, job[0]) == {}, "report() must not write before a flush"
    assert sink.flush_due()


def test_first_report_is_due_at_once_then_every_batch(sink: DatabaseSink) -> None:
    """The first loss is flushed at its own step (launch latency, issue 7 #3); after that
    only every FLUSH_EVERY_POINTS reports (or the time vote) make a flush due."""
    assert not sink.flush_due(), "nothing buffered: nothing due"
    sink.report(1, 0, torch.tensor(1.0))
    assert sink.flush_due()
    sink.flush()
    for step in range(2, FLUSH_EVERY_POINTS + 1):
        sink.report(step, 0, torch.tensor(1.0))
        assert not sink.flush_due(), f"step {step}: due before a full batch"
    sink.report(FLUSH_EVERY_POINTS + 1, 0, torch.tensor(1.0))
    assert sink.flush_due()


def test_flush_writes_one_batch_with_progress(
    db: Database, job: tuple[int, int], sink: DatabaseSink
) -> None:
    job_id, _ = job
    for step in range(1, 121):
        sink.report(step, 0, torch.tensor(1.0 / step))
    sink.report_values(120, 0, {"eval_loss": 0.5, "eval_accuracy": float("nan")})
    sink.flush(Progress(step=120, total_steps=200, epoch=0, samples_per_s=64.0, eta_s=10.0))
    sink.close()
    values = loss_values(db, job_id)
    assert sorted(values) == list(range(1, 121))
    assert values[4] == pytest.approx(0.25)
    assert loss_values(db, job_id, "eval_accuracy") == {120: None}  # NaN stored as NULL
    with db.session(write=False) as s:
        stored = get_job(s, job_id)
        assert stored.progress == {
            "step": 120,
            "total_steps": 200,
            "epoch": 0,
            "samples_per_s": 64.0,
            "eta_s": 10.0,
        }
        assert stored.latest_metrics is not None
        assert stored.latest_metrics["loss"]["step"] == 120
    assert sink.written == 122
    assert sink.latest["eval_loss"] == 0.5


def test_duplicates_are_ignored_on_replay(
    db: Database, job: tuple[int, int], sink: DatabaseSink, caplog: pytest.LogCaptureFixture
) -> None:
    job_id, _ = job
    for step in range(1, 11):
        sink.report(step, 0, torch.tensor(float(step)))
    sink.flush()
    with caplog.at_level(logging.WARNING, logger="worker.runtime.sink"):
        for step in range(5, 16):  # a resumed attempt replays steps 5..10
            sink.report(step, 0, torch.tensor(-1.0))
        sink.flush()
        sink.close()
    values = loss_values(db, job_id)
    assert sorted(values) == list(range(1, 16))
    assert values[5] == 5.0, "the first write of (job, name, step) must win"
    assert values[15] == -1.0
    # A loop whose step restarts every epoch loses points this way: the log says so, once.
    repeats = [r.getMessage() for r in caplog.records if "already stored" in r.getMessage()]
    assert len(repeats) == 1 and re.match(r"6 of (11|21) metric points", repeats[0]), repeats


def _hold_job_row(db: Database, job_id: int) -> object:
    """Open a write transaction that blocks the sink's fenced insert (SQLite: the database
    write lock; PostgreSQL: the job row lock)."""
    scope = db.session()
    session = scope.__enter__()
    session.execute(select(Job).where(Job.id == job_id).with_for_update()).one()
    return scope


def test_flush_never_waits_for_a_blocked_writer(db: Database, job: tuple[int, int]) -> None:
    job_id, _ = job
    sink = DatabaseSink(None, db, *job)
    lock = _hold_job_row(db, job_id)
    try:
        for batch in range(4):  # the writer is stuck on its first batch meanwhile
            for step in range(batch * 10 + 1, batch * 10 + 11):
                sink.report(step, 0, torch.tensor(float(step)))
            start = time.perf_counter()
            sink.flush(Progress(batch * 10 + 10, 40, 0, None, None))
            assert time.perf_counter() - start < 1.0, "flush must not wait for the writer"
        assert sink.held_back == 40, "points the writer has not committed must be held back"
    finally:
        lock.__exit__(None, None, None)  # type: ignore[attr-defined]
    sink.close()
    assert sorted(loss_values(db, job_id)) == list(range(1, 41))
    with db.session(write=False) as s:
        assert get_job(s, job_id).progress["step"] == 40  # type: ignore[index]


def test_backlog_past_the_cap_spills_to_a_file_then_drains_in_order(
    db: Database, job: tuple[int, int], tmp_path: Path
) -> None:
    job_id, _ = job
    spill = tmp_path / "attempt-1" / "metrics-spill.jsonl"
    sink = DatabaseSink(None, db, *job, spill_path=spill, memory_cap=15)
    lock = _hold_job_row(db, job_id)
    try:
        for batch in range(4):
            for step in range(batch * 10 + 1, batch * 10 + 11):
                sink.report(step, 0, torch.tensor(float(step)))
            sink.flush()
        lines = spill.read_bytes().splitlines()
        assert [decode_point(line).step for line in lines] == list(range(16, 41)), (
            "points past the 15 in memory must go to the spill file, oldest first"
        )
    finally:
        lock.__exit__(None, None, None)  # type: ignore[attr-defined]
    sink.close()
    values = loss_values(db, job_id)
    assert sorted(values) == list(range(1, 41)), "every point must arrive, none dropped"
    assert all(values[step] == float(step) for step in values)
    assert sink.spilled_total == 25
    assert not spill.exists(), "a drained spill file is removed"


def test_stale_attempt_stops_writing_and_asks_to_stop(
    db: Database, job: tuple[int, int], sink: DatabaseSink
) -> None:
    job_id, _ = job
    with db.session() as s:  # the worker requeues the job: attempt 2 takes over
        apply_transition(s, Transition(job_id, JobState.RUNNING, JobState.QUEUED))
    sink.report(1, 0, torch.tensor(1.0))
    sink.flush()
    deadline = time.monotonic() + 30
    while not sink.should_stop() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sink.should_stop()
    sink.report(2, 0, torch.tensor(1.0))
    sink.flush()
    sink.close()
    assert loss_values(db, job_id) == {}


def test_null_sink_keeps_nothing(db: Database, job: tuple[int, int]) -> None:
    sink = NullSink(None)
    sink.report(1, 0, torch.tensor(1.0))
    sink.flush(Progress(1, 1, 0, None, None))
    sink.close()
    assert sink.pending == 0
    assert not sink.should_stop()
    assert loss_values(db, job[0]) == {}
