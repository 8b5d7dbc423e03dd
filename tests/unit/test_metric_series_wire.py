"""The rank's metric batches in columns: what ``metric_batch`` sends is what the API reads back
(``checked_columns``), point for point, NaN and ±inf included."""

from __future__ import annotations

import math
from datetime import UTC, datetime

from service.core.metrics.points import MetricPoint, checked_point
from service.core.wire.attempt import MetricBatch
from service.core.wire.metric_columns import checked_columns
from worker.runtime.metrics.backlog import metric_batch


def test_a_batch_in_columns_reads_back_as_the_points_sent() -> None:
    at = datetime(2026, 12, 4, 21, 0, 0, 123456, tzinfo=UTC)
    sent = [
        checked_point(MetricPoint("loss", 1, 0.5, 0, at, 2)),
        checked_point(MetricPoint("acc", 1, math.inf, None, at, None)),
        checked_point(MetricPoint("loss", 2, math.nan, 1, at, 2)),
        checked_point(MetricPoint("loss", 3, -math.inf, 1, at, 0)),  # another ranks: own series
    ]
    body = metric_batch(sent, None).model_dump_json()
    batch = MetricBatch.model_validate_json(body)
    assert [(s.name, s.ranks, s.steps) for s in batch.series] == [
        ("loss", 2, [1, 2]), ("acc", None, [1]), ("loss", 0, [3]),
    ], "one series per (name, ranks), in the order first seen"  # fmt: skip
    columns, refused = checked_columns(batch.series)
    assert refused == []
    got = {(p.name, p.step): p for p in columns.points()}
    for p in sent:
        q = got[(p.name, p.step)]
        assert (q.epoch, q.time, q.ranks) == (p.epoch, p.time, p.ranks), (p, q)
        assert q.value == p.value or (math.isnan(q.value) and math.isnan(p.value)), (p, q)
