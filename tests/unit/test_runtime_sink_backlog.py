"""The metric backlog alone: memory up to the cap, then a spill file read back in order."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path

import pytest

from service.store.metrics.points import MetricPoint
from worker.runtime.metrics.backlog import MetricBacklog, decode_point, encode_point


def points(first: int, last: int) -> list[MetricPoint]:
    return [MetricPoint("loss", step, float(step), epoch=0) for step in range(first, last + 1)]


def steps(batch: list[MetricPoint]) -> list[int]:
    return [p.step for p in batch]


def test_points_survive_the_spill_file_unchanged() -> None:
    at = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    for point in (
        MetricPoint("loss", 7, 0.125, epoch=2, time=at),
        MetricPoint("eval_accuracy", 8, math.inf, epoch=None, time=None),
    ):
        assert decode_point(encode_point(point)) == point
    nan = decode_point(encode_point(MetricPoint("loss", 9, math.nan)))
    assert math.isnan(nan.value)
    with pytest.raises(ValueError, match="not a spilled metric point"):
        decode_point(b'{"name": "loss"}\n')


def test_past_the_cap_newer_points_spill_and_come_back_in_order(tmp_path: Path) -> None:
    spill = tmp_path / "metrics-spill.jsonl"
    backlog = MetricBacklog(spill, memory_cap=4)
    backlog.append(points(1, 10))
    assert (len(backlog), backlog.in_file) == (10, 6)
    assert steps(backlog.peek(3)) == [1, 2, 3]
    backlog.drop_oldest(3)
    # Memory has room again, but older points wait in the file: new ones queue behind them.
    backlog.append(points(11, 12))
    assert backlog.in_file == 8
    written: list[int] = []
    while len(backlog):
        batch = backlog.peek(3)
        written += steps(batch)
        backlog.drop_oldest(len(batch))
    assert written == list(range(4, 13)), "replay must keep the order points were reported in"
    assert not spill.exists(), "a drained spill file is removed"
    backlog.append(points(13, 14))  # below the cap again: memory only
    assert (len(backlog), backlog.in_file, spill.exists()) == (2, 0, False)


def test_persist_keeps_every_unsent_point_oldest_first(tmp_path: Path) -> None:
    spill = tmp_path / "attempt-1" / "metrics-spill.jsonl"
    backlog = MetricBacklog(spill, memory_cap=3)
    backlog.append(points(1, 8))
    backlog.drop_oldest(1)  # written
    assert backlog.peek(10)[0].step == 2  # reads part of the file back into memory
    backlog.append(points(9, 9))
    assert backlog.persist() == 8
    backlog.close()
    kept = [decode_point(line) for line in spill.read_bytes().splitlines()]
    assert steps(kept) == list(range(2, 10))
    assert kept[0] == points(2, 2)[0]


def test_persist_keeps_points_that_were_only_in_memory(tmp_path: Path) -> None:
    """The common end of an outage: a few points below the memory cap, never spilled. The
    file persist writes must survive close (it was removed as "drained")."""
    spill = tmp_path / "metrics-spill.jsonl"
    backlog = MetricBacklog(spill, memory_cap=100)
    backlog.append(points(1, 5))
    assert backlog.persist() == 5
    backlog.close()
    assert spill.exists(), "persisted points were deleted at close"
    assert steps([decode_point(line) for line in spill.read_bytes().splitlines()]) == [
        1,
        2,
        3,
        4,
        5,
    ]


def test_discard_forgets_everything(tmp_path: Path) -> None:
    spill = tmp_path / "metrics-spill.jsonl"
    backlog = MetricBacklog(spill, memory_cap=2)
    backlog.append(points(1, 5))
    assert spill.exists()
    assert backlog.discard() == 5
    assert (len(backlog), spill.exists()) == (0, False)
    backlog.close()
    assert backlog.persist() == 0 and not spill.exists()


def test_unwritable_spill_file_keeps_points_in_memory(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the attempt directory should be")
    backlog = MetricBacklog(blocker / "metrics-spill.jsonl", memory_cap=2)
    backlog.append(points(1, 5))  # must not raise into the training thread
    assert len(backlog) == 5
    assert steps(backlog.peek(10)) == [1, 2, 3, 4, 5]
