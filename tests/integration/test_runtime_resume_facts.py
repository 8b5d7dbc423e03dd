"""What rank 0 tells about its attempt, through the real attempt API into SQLite and
PostgreSQL: a resumed attempt's resume step reaches the API before its first points (so they
replace an earlier attempt's points of those steps), a custom loop that never asked for a
checkpoint tells the step before its first report, checkpoint stalls are told as they happen,
and points say how their values were made."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sqlalchemy import select

from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.store.attempts.goodput import job_ledger
from service.store.db import Database
from service.store.jobs.crud import Transition, apply_transition
from service.store.metrics.points import query_points
from service.store.models import JobAttempt, MetricSuperseded
from tests.rank_api import LiveApi, attempt_client, live_api, running_job
from worker.runtime.checkpoints.saver import NullCheckpointer
from worker.runtime.distributed import DistContext
from worker.runtime.metrics.sink import ApiSink
from worker.runtime.signals import StopFlag
from worker.runtime.timeline import AttemptFacts
from worker.runtime.train.context import TrainContext

CPU = DistContext(0, 0, 1, torch.device("cpu"), "ddp", None)


@pytest.fixture
def api(settings: Settings) -> Iterator[LiveApi]:
    with live_api(settings) as served:
        yield served


def loss(db: Database, job_id: int) -> list[tuple[int, int, int | None]]:
    with db.session(write=False) as s:
        return [(p.step, p.attempt, p.ranks) for p in query_points(s, job_id, "loss")[0]]


def test_the_resume_step_goes_before_the_first_points_of_a_resumed_attempt(
    db: Database, api: LiveApi
) -> None:
    job_id, attempt = running_job(db)
    first = ApiSink(CPU, attempt_client(db, api.url, job_id, attempt))
    facts = AttemptFacts(first)
    facts.begin(0)
    for step in range(1, 8):
        first.report(step, 0, torch.tensor(float(step)))
    first.flush()
    first.close()
    with db.session() as s:
        apply_transition(s, Transition(job_id, JobState.RUNNING, JobState.QUEUED, "lost"))
    _, second_attempt = running_job(db)  # no other job queued: it claims this one again
    assert second_attempt == 2
    second = ApiSink(CPU, attempt_client(db, api.url, job_id, 2))
    facts = AttemptFacts(second)
    with facts.restoring():
        pass
    facts.begin(4)  # then points at once: the writer must send the resume step first
    for step in range(5, 13):
        second.report(step, 0, torch.tensor(100.0 + step))
        if step == 8:
            with facts.checkpoint_stall():  # inside the training window: told
                pass
    second.flush()
    with facts.checkpoint_stall():  # after the last step: teardown, never told as a stall
        pass
    second.flush()
    second.close()
    rows = loss(db, job_id)
    assert [r[0] for r in rows] == list(range(1, 13))
    assert [r[1] for r in rows] == [1] * 4 + [2] * 8, rows
    assert {r[2] for r in rows} == {1}, "a one-rank job's values are its mean over 1 rank"
    with db.session(write=False) as s:
        old = s.scalars(select(MetricSuperseded.step).where(MetricSuperseded.job_id == job_id))
        told = s.get(JobAttempt, (job_id, 2))
        assert sorted(old) == [5, 6, 7]
        assert told is not None and told.resume_step == 4 and told.checkpoint_saves == 1
        assert told.training_started_at is not None and told.restore_s is not None


def test_a_custom_loop_tells_the_step_before_its_first_report(
    db: Database, api: LiveApi, settings: Settings, tmp_path: Path
) -> None:
    job_id, attempt = running_job(db)
    sink = ApiSink(CPU, attempt_client(db, api.url, job_id, attempt))
    ctx = TrainContext(
        spec=JobSpec(name="t", task="regression"),
        dist=CPU,
        sink=sink,
        checkpointer=NullCheckpointer(),
        stop=StopFlag(),
        api=None,
        artifact_dir=tmp_path,
        job_id=job_id,
        attempt=attempt,
    )
    ctx.report(21, 0, loss=0.5)  # a loop that restored itself from step 20
    ctx.save_checkpoint({"w": torch.zeros(2)}, 21)
    ctx.report(22, 0, loss=0.4)
    ctx.save_checkpoint({"w": torch.zeros(2)}, 22)  # the final save: teardown
    ctx.close()
    sink.close()
    with db.session(write=False) as s:
        told = s.get(JobAttempt, (job_id, attempt))
        assert told is not None and told.resume_step == 20, told
        assert told.checkpoint_saves == 1 and told.checkpoint_stall_s is not None
    assert loss(db, job_id) == [(21, 1, 1), (22, 1, 1)]


def test_the_final_saves_stall_is_teardown_not_lost_training(
    db: Database, api: LiveApi, settings: Settings, tmp_path: Path
) -> None:
    # A short job: three quick steps, then a slow final checkpoint after the last one.
    job_id, attempt = running_job(db)
    sink = ApiSink(CPU, attempt_client(db, api.url, job_id, attempt))
    facts = AttemptFacts(sink)
    facts.begin(0)
    for step in range(1, 4):
        sink.report(step, 0, torch.tensor(1.0))
        time.sleep(0.01)
    sink.flush()
    with facts.checkpoint_stall():
        time.sleep(0.2)  # far longer than the training window
    sink.flush()
    sink.close()
    with db.session(write=False) as s:
        told = s.get(JobAttempt, (job_id, attempt))
        assert told is not None and told.checkpoint_saves is None, "the final save: not a stall"
        (line,) = job_ledger(s, job_id).attempts
    p = line.phases
    assert p.checkpoint_stall == 0.0 and p.productive > 0, p
    assert p.in_progress >= 0.2, "the attempt still runs: its time after step 3 is in progress"
