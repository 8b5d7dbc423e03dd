"""A built-in task started with ``init_from`` ``full`` from a step at or past its total steps
(real trainer on CPU, real attempt API into SQLite and PostgreSQL): it trains nothing, and the
job's events say so instead of a silent success."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.store.db import Database
from service.store.jobs.crud import list_events
from tests.rank_api import LiveApi, attempt_client, live_api, running_job
from worker.runtime.checkpoints.fetch import StartPoint
from worker.runtime.checkpoints.saver import Checkpointer
from worker.runtime.distributed import DistContext
from worker.runtime.metrics.sink import ApiSink
from worker.runtime.signals import StopFlag
from worker.runtime.train.context import TrainContext
from worker.runtime.train.trainer import Trainer
from worker.tasks import regression
from worker.tasks.base import TaskSetup

CPU = DistContext(0, 0, 1, torch.device("cpu"), "ddp", None)


@pytest.fixture
def api(settings: Settings) -> Iterator[LiveApi]:
    with live_api(settings) as served:
        yield served


def test_a_full_init_past_the_last_step_trains_nothing_and_says_so(
    db: Database, api: LiveApi, settings: Settings, tmp_path: Path
) -> None:
    spec = JobSpec.model_validate(
        {"name": "ft", "task": "regression", "training": {"epochs": 1, "batch_size": 8}}
    )
    job_id, attempt = running_job(db, spec)
    stop = StopFlag()
    parts = regression.build(TaskSetup(config={}, seed=0, rank=0, world_size=1, stop=stop))
    source = tmp_path / "source.pt"
    torch.save({"model": parts.model.state_dict(), "step": 10_000}, source)
    sink = ApiSink(CPU, attempt_client(db, api.url, job_id, attempt))
    root = settings.resolved_artifact_dir
    client = attempt_client(db, api.url, job_id, attempt)
    ckpt = Checkpointer(client, root, job_id, attempt, keep=1, transport="upload")
    ctx = TrainContext(spec=spec, dist=CPU, sink=sink, checkpointer=ckpt, stop=stop, api=None,
                       artifact_dir=root, job_id=job_id,
                       attempt=attempt)  # fmt: skip
    trainer = Trainer(parts, ctx, StartPoint(source, "init", "full"))
    trainer.run()
    ctx.close()
    sink.close()
    total = trainer.total_steps
    assert total < 10_000
    with db.session(write=False) as s:
        found = [e.reason or "" for e in list_events(s, job_id)]
    assert any(r.startswith(f"init_from step 10000 ≥ this job's {total} steps: nothing to train")
               for r in found), found  # fmt: skip
