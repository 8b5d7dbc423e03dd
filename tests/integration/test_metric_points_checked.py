"""Points are checked on their way in: ``checked_report`` in ``ctx.report`` (so a bad report
raises in the loop; each context remembers the names it checked), and ``checked_point``, the
one constructor of the ``CheckedPoint``s ``record_metrics`` takes, when rank 0 publishes a
batch (a bad Trainer point is dropped there). A ``CheckedPoint`` passes later checks as it is."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from service.core.config import Settings
from service.core.metrics import points as metric_points
from service.core.metrics.points import CheckedPoint, MetricPoint, checked_point, checked_report
from service.core.spec.model import JobSpec
from service.store.db import Database
from tests.integration.test_runtime_sink import loss_values
from tests.rank_api import LiveApi, attempt_client, live_api, running_job
from worker.runtime.checkpoints.saver import NullCheckpointer
from worker.runtime.distributed import DistContext
from worker.runtime.metrics.buffer import _stacked
from worker.runtime.metrics.sink import ApiSink
from worker.runtime.signals import StopFlag
from worker.runtime.train.context import TrainContext


def test_checked_point_returns_a_checked_point_equal_to_its_plain_twin() -> None:
    at = datetime(2026, 1, 1, 1, tzinfo=timezone(timedelta(hours=1)))
    step: Any = np.int64(3)  # what loops compute steps with
    epoch: Any = np.int32(1)
    point = checked_point(MetricPoint("loss", step, -0.0, epoch, at))
    assert type(point) is CheckedPoint
    assert point == MetricPoint("loss", 3, 0.0, 1, at.astimezone(UTC))
    assert MetricPoint("loss", 3, 0.0, 1, at.astimezone(UTC)) == point  # either side
    assert hash(point) == hash(MetricPoint("loss", 3, 0.0, 1, at.astimezone(UTC)))
    assert point != MetricPoint("loss", 4, 0.0, 1, at.astimezone(UTC))
    assert checked_point(point) is point, "checked already: passed through"


@pytest.mark.parametrize(
    ("step", "epoch", "name"),
    [(0, None, "loss"), (2**53, None, "loss"), (1, -1, "loss"), (1, 2**31, "loss"),
     (1, None, "x" * 101), (1, None, ""), (1, None, "a\x00b"), (1, None, "a\ud800"),
     (1.5, None, "loss")],
)  # fmt: skip
def test_checked_report_refuses_what_checked_point_refuses(
    step: int, epoch: int | None, name: str
) -> None:
    with pytest.raises(ValueError) as by_point:
        checked_point(MetricPoint(name, step, 0.0, epoch))
    with pytest.raises(ValueError) as by_report:
        checked_report(step, epoch, [name])
    assert str(by_report.value) == str(by_point.value)
    if name != "loss":
        with pytest.raises(ValueError, match="metric name"):
            checked_report(1, 0, ["ok", name])  # every name is checked, not just the first


def test_checked_report_remembers_good_names_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metric_points, "MAX_KNOWN_NAMES", 2)
    known: set[str] = set()  # the caller's own (a TrainContext holds one): no module state
    checked_report(1, None, ["a", "b", "c"], known)
    assert known == {"a", "b"}, "bounded"
    for _ in range(2):  # a refused name is never remembered
        with pytest.raises(ValueError, match="metric name"):
            checked_report(1, None, ["x" * 101], known)
    assert known == {"a", "b"}


def test_checked_report_gives_plain_ints() -> None:
    step, epoch = checked_report(torch.tensor(7), np.int64(2), ["loss"])
    assert (type(step), type(epoch), step, epoch) == (int, int, 7, 2)
    assert checked_report(np.int64(1), None, []) == (1, None)


@pytest.fixture
def api(db: Database, settings: Settings) -> Iterator[LiveApi]:
    with live_api(settings) as served:
        yield served


def _counting_name_checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names checked on the training (main) thread: the rank's own checks. The API
    serving in this process checks the points again on its threads; those are the server's."""
    seen: list[str] = []
    check: Callable[[object], None] = metric_points._check_name

    def counted(name: object) -> None:
        if threading.current_thread() is threading.main_thread():
            seen.append(str(name))
        check(name)

    monkeypatch.setattr(metric_points, "_check_name", counted)
    return seen


def test_ctx_report_points_are_checked_once_and_all_written(
    db: Database, api: LiveApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id, attempt = running_job(db)
    dist = DistContext(0, 0, 1, torch.device("cpu"), "ddp", None)
    client = attempt_client(db, api.url, job_id, attempt)
    sink = ApiSink(dist, client, spill_path=tmp_path / "spill.jsonl")
    spec = JobSpec.model_validate({"name": "c", "task": "examples.custom_loop:train"})
    ctx = TrainContext(spec=spec, dist=dist, sink=sink, checkpointer=NullCheckpointer(),
                       stop=StopFlag(), api=None, artifact_dir=tmp_path, job_id=job_id,
                       attempt=attempt)  # fmt: skip
    checks = _counting_name_checks(monkeypatch)
    for step in range(1, 31):
        ctx.report(step, 0, loss=torch.tensor(-0.0 if step == 1 else float(step)), acc=-0.0)
    # Once per name by report, then remembered; the first report flushes its two points,
    # and publishing builds each CheckedPoint with checked_point.
    assert checks == ["loss", "acc"] * 2, "a name is checked once, then remembered"
    ctx.flush()
    sink.close()
    # Publishing builds each CheckedPoint with checked_point (once); the write checks nothing.
    assert checks[:2] == ["loss", "acc"] and len(checks) == 2 + 60
    loss, acc = loss_values(db, job_id), loss_values(db, job_id, "acc")
    assert loss == {s: float(s) for s in range(1, 31)} | {1: 0.0}
    assert acc == dict.fromkeys(range(1, 31), 0.0)
    signs = [math.copysign(1.0, v) for v in (loss[1], *acc.values()) if v is not None]
    assert signs == [1.0] * 31, "-0.0 is stored as 0.0 (SQLite cannot keep the sign)"


def test_trainer_points_are_checked_once_at_flush_and_a_bad_one_dropped(
    db: Database, api: LiveApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id, attempt = running_job(db)
    client = attempt_client(db, api.url, job_id, attempt)
    sink = ApiSink(None, client, spill_path=tmp_path / "spill.jsonl")
    checks = _counting_name_checks(monkeypatch)
    for step in range(1, 11):
        sink.report(step, 0, torch.tensor(float(step)))
    sink.report(11, 0, torch.tensor(1.0), name="x" * 101)  # unchecked: refused at flush
    sink.flush(average=False)
    sink.close()
    assert len(checks) == 11
    assert loss_values(db, job_id) == {s: float(s) for s in range(1, 11)}


def test_stacked_matches_one_conversion_per_tensor() -> None:
    mixed = [
        torch.tensor(1.5),
        torch.tensor(2, dtype=torch.int64),
        torch.tensor([3.25]),
        torch.tensor(0.1, dtype=torch.float64),
        torch.tensor(4.0, dtype=torch.bfloat16),
    ]
    for tensors in (mixed, [torch.tensor(float(i)) for i in range(5)], mixed[2:3] * 3):
        one_by_one = torch.stack([t.reshape(()).to(torch.float32) for t in tensors])
        assert torch.equal(_stacked(tensors), one_by_one)
    with pytest.raises(RuntimeError):
        _stacked([torch.tensor(1.0), torch.tensor([1.0, 2.0])])
    with pytest.raises(RuntimeError):
        _stacked([torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])])
