"""The rank's metrics sink against a real API whose job is at its points-per-minute quota:
the refused batch (429 with Retry-After) stays in the backlog, is sent again once the window
has passed, and every point is stored exactly once."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import select

from service.core.config import Settings
from service.store.db import Database
from service.store.models import Job, JobEvent, utcnow
from tests.integration.test_runtime_sink import loss_values
from tests.rank_api import LiveApi, attempt_client, live_api, running_job
from tests.waiting import wait_until
from worker.runtime.metrics.sink import ApiSink

PER_MINUTE = 100


@pytest.fixture
def api(db: Database, settings: Settings) -> Iterator[LiveApi]:
    with live_api(settings.model_copy(update={"metric_points_per_minute": PER_MINUTE})) as served:
        yield served


def test_a_batch_refused_for_the_rate_is_sent_again_after_retry_after_and_stored_once(
    db: Database, api: LiveApi, tmp_path: Path
) -> None:
    job_id, attempt = running_job(db)
    with db.session() as s:  # the job's window is nearly full and ends in about 2 s
        job = s.get_one(Job, job_id)
        job.metric_window_at = utcnow() - timedelta(seconds=58)
        job.metric_window_points = PER_MINUTE - 5
    sink = ApiSink(None, attempt_client(db, api.url, job_id, attempt),
                   spill_path=tmp_path / "spill.jsonl")  # fmt: skip
    for step in range(1, 21):
        sink.report(step, 0, torch.tensor(float(step)))
    sink.flush()

    def refused_once() -> bool:
        with db.session(write=False) as s:
            events = s.scalars(select(JobEvent.kind).where(JobEvent.job_id == job_id)).all()
            return "quota_exceeded" in events

    wait_until(refused_once, 30, "the rate's refusal noted on the job")
    assert sink.drain(timeout_s=30), "sent once the window passed"
    sink.close()
    assert loss_values(db, job_id) == {s: float(s) for s in range(1, 21)}
    assert sink.discarded == 0 and sink.written == 20


NAMES = 3


def test_past_the_name_quota_the_sink_sends_only_stored_names_and_loses_none_of_them(
    db: Database, settings: Settings, tmp_path: Path
) -> None:
    """A batch bringing names past ``DDPQ_METRIC_NAMES_PER_JOB`` is refused whole (422); the
    sink sends it again without its new names, and drops later points of new names before
    sending them: the stored names' points are each stored once, nothing else is."""
    job_id, attempt = running_job(db)
    with live_api(settings.model_copy(update={"metric_names_per_job": NAMES})) as served:
        sink = ApiSink(None, attempt_client(db, served.url, job_id, attempt),
                       spill_path=tmp_path / "spill.jsonl")  # fmt: skip
        sink.report_values(1, 0, {"loss": 1.0, "acc": 0.1}, reduced=True)
        sink.flush(average=False)
        assert sink.drain(timeout_s=30)
        # Two names stored, one left: this batch brings three new ones, so it is refused.
        sink.report_values(2, 0, {"loss": 2.0, "acc": 0.2, "n1": 1, "n2": 2, "n3": 3},
                           reduced=True)  # fmt: skip
        sink.flush(average=False)
        assert sink.drain(timeout_s=30)
        assert sink.names.full and sink.names.dropped == 3
        sink.report_values(3, 0, {"loss": 3.0, "n4": 4}, reduced=True)
        sink.flush(average=False)
        assert sink.drain(timeout_s=30)
        # Every point handed over counts as settled (a checkpoint waits on this), none early.
        assert sink.wait_written(sink.handed(), 5)
        sink.close()
    assert sink.names.dropped == 4, "n4 was dropped before it was sent"
    assert loss_values(db, job_id) == {1: 1.0, 2: 2.0, 3: 3.0}
    assert loss_values(db, job_id, "acc") == {1: 0.1, 2: 0.2}
    assert all(loss_values(db, job_id, f"n{i}") == {} for i in range(1, 5))
    assert sink.discarded == 0
    with db.session(write=False) as s:
        kinds = s.scalars(select(JobEvent.kind).where(JobEvent.job_id == job_id)).all()
    assert kinds.count("quota_exceeded") == 1, kinds


def test_a_resumed_sink_that_knows_no_names_keeps_the_jobs_names_in_one_more_request(
    db: Database, settings: Settings, tmp_path: Path
) -> None:
    """A sink that has had no name stored yet (a resumed attempt) whose first batch is
    refused for the quota learns from the refusal which of the batch's names the job has: it
    sends those names' points again in one request, drops the new ones, and never sends
    points of new names after that."""
    job_id, attempt = running_job(db)
    with live_api(settings.model_copy(update={"metric_names_per_job": NAMES})) as served:

        def sink_of() -> ApiSink:
            return ApiSink(None, attempt_client(db, served.url, job_id, attempt),
                           spill_path=tmp_path / f"spill-{id(object())}.jsonl")  # fmt: skip

        earlier = sink_of()  # the earlier attempt's: the job's three names
        earlier.report_values(1, 0, {"loss": 1.0, "acc": 0.1, "lr": 0.5}, reduced=True)
        earlier.flush(average=False)
        assert earlier.drain(timeout_s=30)
        earlier.close()
        sink = sink_of()
        sent: list[set[str]] = []
        send = sink.client.send_metrics

        def counted(batch: Any) -> Any:
            sent.append({s.name for s in batch.series} | {r[0] for r in batch.points})
            return send(batch)

        sink.client.send_metrics = counted  # type: ignore[method-assign]
        sink.report_values(2, 0, {"loss": 2.0, "acc": 0.2, "n5": 5, "n7": 7}, reduced=True)
        sink.flush(average=False)
        assert sink.drain(timeout_s=30)
        sink.report_values(3, 0, {"loss": 3.0, "acc": 0.3, "n6": 6}, reduced=True)
        sink.flush(average=False)
        assert sink.drain(timeout_s=30)
        assert sink.wait_written(sink.handed(), 5)
        sink.close()
    assert loss_values(db, job_id) == {1: 1.0, 2: 2.0, 3: 3.0}
    assert loss_values(db, job_id, "acc") == {1: 0.1, 2: 0.2, 3: 0.3}
    assert loss_values(db, job_id, "n5") == {} and loss_values(db, job_id, "n6") == {}
    assert sink.names.dropped == 3 and sink.discarded == 0
    # The refused batch, its known names again, then step 3 without n6: no name-by-name probe.
    assert sent == [{"loss", "acc", "n5", "n7"}, {"loss", "acc"}, {"loss", "acc"}], sent
