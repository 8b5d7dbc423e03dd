"""The rank-0 sink through an attempt API outage, on real SQLite and PostgreSQL.

The outage is real: the sink first posts to the attempt API's port while nobody serves it
(every connection is refused), then the real API is started on that port, as when
``ddpq serve`` restarts. Also: 429 with ``Retry-After`` is honoured, and a flush whose
all_reduce breaks (the peer rank died) still hands rank 0's points over (two gloo processes).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist
from sqlalchemy import func, select

from service.core.config import Settings
from service.core.wire import API_PREFIX
from service.core.wire.attempt import METRICS_PATH, MetricBatchAck
from service.store.db import Database
from service.store.jobs.crud import get_job
from service.store.metrics.points import MetricPoint, query_points, record_metrics
from service.store.models import Metric
from tests.rank_api import LiveApi, attempt_client, live_api, mint_token, rank_environ, running_job
from tests.waiting import wait_until
from worker.runtime.attempt_client import AttemptClient
from worker.runtime.distributed import DistContext
from worker.runtime.metrics.backlog import decode_point
from worker.runtime.metrics.buffer import Progress
from worker.runtime.metrics.sink import ApiSink, make_sink
from worker.runtime.topology import RankEnv

# Nothing listens on port 1: every connection is refused at once.
UNREACHABLE_URL = "http://127.0.0.1:1"


@pytest.fixture
def down(db: Database, settings: Settings) -> Iterator[LiveApi]:
    """The attempt API's port, not served yet (``start()`` ends the outage)."""
    api = LiveApi(settings)
    yield api
    api.stop()


@pytest.fixture
def job(db: Database) -> tuple[int, int]:
    """A job claimed by a worker and running: ``(job_id, attempt)``."""
    return running_job(db)


def report_steps(sink: ApiSink, first: int, last: int, total: int) -> None:
    """Report ``loss = step`` for each step, flushing every 10 steps with progress."""
    for step in range(first, last + 1):
        sink.report(step, 0, torch.tensor(float(step)))
        if step % 10 == 0 or step == last:
            sink.flush(Progress(step, total, 0, None, None))


def stored_losses(db: Database, job_id: int) -> tuple[dict[int, float | None], int]:
    """``({step: value}, row count)`` of the job's ``loss`` rows."""
    with db.session(write=False) as s:
        points, _ = query_points(s, job_id, "loss", limit=100_000)
        rows = s.scalar(select(func.count()).where(Metric.job_id == job_id, Metric.name == "loss"))
    return {p.step: p.value for p in points}, int(rows or 0)


def _with_repo_on_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the repository on PYTHONPATH: a rank run as ``python <this file>`` has
    only this file's folder on sys.path, and imports ``tests.rank_api``."""
    repo = str(Path(__file__).resolve().parents[2])
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))}


def test_outage_spills_then_replays_every_point_exactly_once(
    db: Database, down: LiveApi, job: tuple[int, int], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    job_id, attempt = job
    spill = tmp_path / "metrics-spill.jsonl"
    client = attempt_client(db, down.url, *job)
    sink = ApiSink(None, client, spill_path=spill, memory_cap=20, close_timeout_s=5)
    try:
        with caplog.at_level(logging.WARNING, logger="worker.runtime.metrics.sink"):
            start = time.perf_counter()
            report_steps(sink, 1, 100, total=100)
            assert time.perf_counter() - start < 5.0, "training must not wait for the database"
            wait_until(lambda: "metrics writer" in caplog.text, 30, "a failed write")
        assert sink.held_back == 100
        spilled = [decode_point(line).step for line in spill.read_bytes().splitlines()]
        assert spilled == list(range(21, 101)), "points past the cap must go to the file"
        # A batch the API stored just before the connection died, unacknowledged: replaying
        # it must not store it twice.
        with db.session() as s:
            record_metrics(s, job_id, attempt, [MetricPoint("loss", 5, 5.0, 0)])

        down.start()  # the API is back, on the same port
        wait_until(lambda: sink.held_back == 0, 60, "the backlog to drain")
    finally:
        sink.close()
    values, rows = stored_losses(db, job_id)
    assert rows == 100 and sorted(values) == list(range(1, 101)), "each step exactly once"
    assert all(values[step] == float(step) for step in values)
    with db.session(write=False) as s:
        assert get_job(s, job_id).progress["step"] == 100  # type: ignore[index]
    assert not spill.exists(), "the spill file is removed once replayed"
    assert "attempt API back after" in caplog.text or sink.written == 100


def test_close_waits_for_the_api_to_come_back(
    db: Database, down: LiveApi, job: tuple[int, int], tmp_path: Path
) -> None:
    """The stop path: the final batch is handed over while the API is down; close() must
    keep it until it is written, not drop it after one failed try."""
    job_id, _attempt = job
    client = attempt_client(db, down.url, *job)
    sink = ApiSink(None, client, spill_path=tmp_path / "spill.jsonl", close_timeout_s=30)
    report_steps(sink, 1, 30, total=30)
    closer = threading.Thread(target=sink.close)
    closer.start()
    time.sleep(1.0)  # a few refused writes
    assert closer.is_alive(), "close() must not give up while it has points to write"
    down.start()
    closer.join(60)
    assert not closer.is_alive()
    values, rows = stored_losses(db, job_id)
    assert rows == 30 and sorted(values) == list(range(1, 31))


def test_drain_returns_only_once_every_handed_over_point_is_stored(
    db: Database, down: LiveApi, job: tuple[int, int], tmp_path: Path
) -> None:
    """The end of training drains before its stop checkpoint: the next attempt resumes after
    that checkpoint, so a point still queued when the rank is killed would be lost."""
    job_id, _attempt = job
    client = attempt_client(db, down.url, *job)
    sink = ApiSink(None, client, spill_path=tmp_path / "spill.jsonl", close_timeout_s=5)
    try:
        report_steps(sink, 1, 25, total=25)
        assert not sink.drain(0.5), "nothing is stored while the API is down"
        assert sink.held_back == 25
        down.start()
        assert sink.drain(60)
        values, rows = stored_losses(db, job_id)  # stored before drain returned, not after
        assert rows == 25 and sorted(values) == list(range(1, 26))
    finally:
        sink.close()


def test_close_timeout_keeps_every_unsent_point_in_the_spill_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spill = tmp_path / "attempt-1" / "metrics-spill.jsonl"
    client = AttemptClient(UNREACHABLE_URL, "ddpqa_never")
    sink = ApiSink(None, client, spill_path=spill, memory_cap=5, close_timeout_s=0.5)
    report_steps(sink, 1, 12, total=12)
    with caplog.at_level(logging.ERROR, logger="worker.runtime.metrics.sink"):
        sink.close()
    assert "12 metric points could not be written" in caplog.text
    kept = [decode_point(line) for line in spill.read_bytes().splitlines()]
    assert [p.step for p in kept] == list(range(1, 13)), "nothing may be lost, oldest first"
    assert [p.value for p in kept] == [float(s) for s in range(1, 13)]


def test_429_retry_after_is_honoured_and_the_batch_resent_once(tmp_path: Path) -> None:
    """Back-pressure: the API refuses the batch twice with 429 + Retry-After: 1; the sink
    waits at least that long each time, then the same batch goes through, once."""
    calls: list[tuple[float, list[int]]] = []  # (when, the steps sent)

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == API_PREFIX + METRICS_PATH
        assert request.headers["Authorization"] == "Bearer ddpqa_t"
        body = json.loads(request.content)
        calls.append((time.monotonic(), [s for series in body["series"] for s in series["steps"]]))
        if len(calls) <= 2:
            return httpx.Response(429, headers={"Retry-After": "1"}, json={"detail": "busy"})
        n = len(calls[-1][1])
        return httpx.Response(200, json=MetricBatchAck(accepted=n, inserted=n).model_dump())

    client = AttemptClient("http://api.test", "ddpqa_t", transport=httpx.MockTransport(answer))
    sink = ApiSink(None, client, spill_path=tmp_path / "spill.jsonl", close_timeout_s=10)
    report_steps(sink, 1, 10, total=10)
    sink.close()
    assert len(calls) == 3, f"two refusals, then one accepted batch: {len(calls)} requests"
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(calls)]
    assert all(gap >= 0.95 for gap in gaps), f"Retry-After (1 s) not honoured: {gaps}"
    assert calls[-1][1] == list(range(1, 11)), "the same batch, in order"
    assert sink.written == 10 and sink.held_back == 0


def _broken_flush_rank(rank: int, store_path: str, environ: str, out: str) -> None:
    """Rank 1 leaves after one all_reduce; rank 0 then flushes 5 reported steps."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    dist.all_reduce(torch.zeros(1))
    if rank == 1:
        os._exit(0)  # dies without a word, as a killed peer would
    ctx = DistContext(0, 0, 2, torch.device("cpu"), "ddp", "gloo", None)
    sink = make_sink(RankEnv.from_environ(json.loads(environ)), ctx)
    for step in range(1, 6):
        sink.report(step, 0, torch.tensor(float(step)))
    time.sleep(1.0)  # let rank 1 be gone
    raised = None
    try:
        sink.flush()
    except RuntimeError as exc:
        raised = str(exc)
    sink.close()
    Path(out).write_text(json.dumps({"raised": raised}))
    os._exit(0)  # skip gloo's teardown with a dead peer


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_flush_whose_all_reduce_breaks_still_writes_rank0_points(
    db: Database, settings: Settings, job: tuple[int, int], tmp_path: Path
) -> None:
    job_id, attempt = job
    out = tmp_path / "rank-0.json"
    with live_api(settings) as api:
        environ = rank_environ(api.url, mint_token(db, job_id, attempt), job_id, attempt)
        args = [str(tmp_path / "store"), json.dumps(environ), str(out)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, str(rank), *args], env=_with_repo_on_path(env)
            )
            for rank in range(2)
        ]
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    written = json.loads(out.read_text())
    assert written["raised"], "the flush must report the broken collective"
    values, _ = stored_losses(db, job_id)
    assert values == {step: float(step) for step in range(1, 6)}, "rank 0's own values"
    with db.session(write=False) as s:
        made = {p.ranks for p in query_points(s, job_id, "loss")[0]}
    assert made == {0}, f"stored as rank 0's own (not a mean over 2 ranks): {made}"


if __name__ == "__main__":  # one rank, started by the test above
    _broken_flush_rank(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
