"""The rank-0 metrics sink through the real attempt API (uvicorn on loopback) into real SQLite
and PostgreSQL: cheap reports, batched writes, duplicates ignored, a backlog (then a spill file)
while the writer is blocked, fencing on a stale attempt. API outages:
test_runtime_sink_outage.py."""

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
from service.core.config import Settings
from service.core.states import JobState
from service.store.db import Database
from service.store.jobs.crud import Transition, apply_transition, get_job
from service.store.metrics.points import query_points
from service.store.models import Job
from tests.rank_api import LiveApi, attempt_client, live_api, mint_token, rank_environ, running_job
from worker.runtime.metrics.backlog import decode_point
from worker.runtime.metrics.buffer import FLUSH_EVERY_POINTS, NullSink, Progress
from worker.runtime.metrics.sink import ApiSink, make_sink
from worker.runtime.topology import RankEnv


@pytest.fixture
def api(db: Database, settings: Settings) -> Iterator[LiveApi]:
    with live_api(settings) as served:
        yield served


@pytest.fixture
def job(db: Database) -> tuple[int, int]:
    return running_job(db)


def api_sink(db: Database, api: LiveApi, job: tuple[int, int], **kw: object) -> ApiSink:
    return ApiSink(None, attempt_client(db, api.url, *job), **kw)  # type: ignore[arg-type]


@pytest.fixture
def sink(db: Database, api: LiveApi, job: tuple[int, int]) -> Iterator[ApiSink]:
    s = api_sink(db, api, job)
    yield s
    s.close()


def loss_values(db: Database, job_id: int, name: str = "loss") -> dict[int, float | None]:
    with db.session(write=False) as s:
        points, _ = query_points(s, job_id, name, limit=100_000)
        return {p.step: p.value for p in points}


def test_make_sink_picks_by_rank(
    db: Database, api: LiveApi, job: tuple[int, int], tmp_path: Path
) -> None:
    environ = rank_environ(api.url, mint_token(db, *job), *job)
    chief = make_sink(RankEnv.from_environ(environ), None, artifact_dir=tmp_path)
    other = make_sink(
        RankEnv.from_environ({**environ, "RANK": "1", "WORLD_SIZE": "2"}), None,
        artifact_dir=tmp_path,
    )  # fmt: skip
    try:
        assert isinstance(chief, ApiSink)
        assert isinstance(other, NullSink)
        assert chief.spill_path == metrics_spill_path(tmp_path, *job)
    finally:
        chief.close()


def test_report_is_cheap_and_writes_nothing_until_flush(
    db: Database, job: tuple[int, int], sink: ApiSink
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


def test_first_report_is_due_at_once_then_every_batch(sink: ApiSink) -> None:
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
    db: Database, job: tuple[int, int], sink: ApiSink
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
    db: Database, job: tuple[int, int], sink: ApiSink, caplog: pytest.LogCaptureFixture
) -> None:
    job_id, _ = job
    for step in range(1, 11):
        sink.report(step, 0, torch.tensor(float(step)))
    sink.flush()
    with caplog.at_level(logging.WARNING, logger="worker.runtime.metrics.sink"):
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
    """Open a write transaction that blocks the API's fenced insert (SQLite: the database
    write lock; PostgreSQL: the job row lock): the sink's requests wait, time out or get a
    503, and the sink must hold its points meanwhile."""
    scope = db.session()
    session = scope.__enter__()
    session.execute(select(Job).where(Job.id == job_id).with_for_update()).one()
    return scope


def test_flush_never_waits_for_a_blocked_writer(
    db: Database, api: LiveApi, job: tuple[int, int]
) -> None:
    job_id, _ = job
    sink = api_sink(db, api, job)
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
    db: Database, api: LiveApi, job: tuple[int, int], tmp_path: Path
) -> None:
    job_id, _ = job
    spill = tmp_path / "attempt-1" / "metrics-spill.jsonl"
    sink = api_sink(db, api, job, spill_path=spill, memory_cap=15)
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
    db: Database, job: tuple[int, int], sink: ApiSink
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
