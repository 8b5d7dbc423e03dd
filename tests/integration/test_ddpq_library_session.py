"""The ``ddpq`` library inside an entrypoint rank reaches the rank's own ``TrainContext``:
one sink, one checkpointer, one stop vote (through the real attempt API, SQLite and
PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ddpq
from ddpq import _state
from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.store.db import Database
from service.store.metrics.points import query_points
from tests.rank_api import LiveApi, attempt_client, live_api, running_job
from worker.runtime.checkpoints.saver import NullCheckpointer
from worker.runtime.distributed import DistContext
from worker.runtime.metrics.sink import ApiSink
from worker.runtime.signals import StopFlag
from worker.runtime.train.context import TrainContext

CPU = DistContext(0, 0, 1, torch.device("cpu"), "ddp", None)


@pytest.fixture
def api(settings: Settings) -> Iterator[LiveApi]:
    with live_api(settings) as served:
        yield served


@pytest.fixture(autouse=True)
def forget_session() -> Iterator[None]:
    yield
    _state.use(None)


def test_ddpq_calls_in_an_entrypoint_reach_its_context(
    db: Database, api: LiveApi, tmp_path: Path
) -> None:
    job_id, attempt = running_job(db)
    sink = ApiSink(CPU, attempt_client(db, api.url, job_id, attempt))
    stop = StopFlag()
    ctx = TrainContext(
        spec=JobSpec(name="t", task="regression", config={"lr": 0.5}), dist=CPU, sink=sink,
        checkpointer=NullCheckpointer(), stop=stop, api=None, artifact_dir=tmp_path,
        job_id=job_id, attempt=attempt,
    )  # fmt: skip
    _state.use(ctx)  # as worker.runtime.main does around the entrypoint
    assert ddpq.config({"lr": 0.1, "epochs": 3}) == {"lr": 0.5, "epochs": 3}
    info = ddpq.info()
    assert (info.under_ddpq, info.job_id, info.attempt, info.world_size) == (
        True, job_id, attempt, 1,
    )  # fmt: skip
    ddpq.report(1, epoch=0, loss=torch.tensor(0.75))
    ctx.report(2, 0, loss=0.5)  # the context's own call, into the same sink
    ddpq.report(3, loss=0.25, mean=True)
    assert ddpq.should_stop() is False
    stop.request("received SIGTERM", 15)
    assert ddpq.should_stop() is True and ctx.stopped, "one stop flag, one vote"
    ctx.close()
    sink.close()
    with db.session(write=False) as s:
        points = query_points(s, job_id, "loss")[0]
    assert [(p.step, p.value) for p in points] == [(1, 0.75), (2, 0.5), (3, 0.25)]
    assert ctx.last_step == 3
