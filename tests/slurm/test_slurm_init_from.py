"""``init_from`` into a 2-node Slurm job: a 2-rank job's checkpoint starts a job of one rank on
each of two nodes (the dev cluster's nodes share this host's disk, so the first rank of the
second node finds the file verified in place rather than downloading it; the download itself
is covered by tests/e2e/test_checkpoint_hosts.py). The first loss is close to the source's
last, and both ranks loaded it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.store.db import Database
from service.store.models import Metric
from tests.slurm.conftest import SlurmDb, job_row, running_worker, submit
from tests.waiting import wait_until

pytestmark = pytest.mark.slurm

SOURCE = {
    "task": "regression",
    "backend": "gloo",
    "resources": {"nnodes": 1, "nproc_per_node": 2, "timeout_min": 10},
    "training": {"max_steps": 80, "batch_size": 32, "lr": 0.003},
    "config": {"num_samples": 1024},
}


def losses(db: Database, job_id: int) -> list[tuple[int, float]]:
    with db.session(write=False) as s:
        rows = s.execute(
            select(Metric.step, Metric.value)
            .where(Metric.job_id == job_id, Metric.name == "loss")
            .order_by(Metric.step)
        ).all()
    return [(int(step), float(value)) for step, value in rows]


def _finished(db: Database, job_id: int) -> JobState | None:
    state = JobState(job_row(db, job_id).state)
    return state if state.is_terminal else None


def test_init_from_a_2_rank_checkpoint_into_a_2_node_job(slurm_db: SlurmDb, tmp_path: Path) -> None:
    settings, db = slurm_db
    worker = settings.model_copy(update={"artifact_dir": tmp_path / "worker-artifacts"})
    source = submit(db, settings, SOURCE)
    with running_worker(worker):
        state = wait_until(lambda: _finished(db, source), 180, "the source job to finish")
        assert state == JobState.SUCCEEDED, job_row(db, source).error
        before = losses(db, source)
        first, last = before[0][1], before[-1][1]
        assert last < 0.8 * first, f"the source must learn something: {first} → {last}"
        spec = {
            **SOURCE,
            "name": "slurm-init-from",
            "launcher": "slurm",
            "resources": {"nnodes": 2, "nproc_per_node": 1, "timeout_min": 10},
            "training": {"max_steps": 10, "batch_size": 32},
            "init_from": {"job": source, "step": "latest", "mode": "weights_only"},
        }
        # Through the API, which resolves init_from to one committed checkpoint at submit.
        r = httpx.post(f"{settings.api_url}{API_PREFIX}/jobs", json=spec, timeout=30)
        assert r.status_code == 201, r.text
        target = int(r.json()["id"])
        state = wait_until(lambda: _finished(db, target), 180, "the 2-node job to finish")
    job = job_row(db, target)
    assert state == JobState.SUCCEEDED, job.error
    after = losses(db, target)
    assert after[0][0] == 1, "weights_only starts at step 1"
    assert abs(after[0][1] - last) < 0.5 * abs(first - last), (
        f"first loss {after[0][1]} should be near the source's last {last} (first {first})"
    )
    attempt_dir = worker.resolved_artifact_dir / "jobs" / str(target) / "attempt-1"
    for rank in (0, 1):  # one rank per node: both loaded it
        log = (attempt_dir / f"rank-{rank}.log").read_text(errors="replace")
        assert "initialised from another job's checkpoint (weights_only)" in log, log[-3000:]
