"""Outages mid-job: training goes on, the job succeeds, every step's loss is stored exactly
once, no job changes state, and the worker lives through it.

- The API server stopped for 10 s and started again on the same port: the rank-0 sink holds
  its points and replays them, training throughput is unchanged meanwhile; the worker, which
  reaches only the API, retries with backoff and renews its leases once the API is back (its
  lease, 45 s here, outlasts the outage and the restart: a worker cut off for longer stops its
  ranks before the lease can lapse, ``tests/e2e/test_worker_partition.py``).
- PostgreSQL restarted: the API answers 503 meanwhile (the rank-0 sink retries), the worker
  rides it out. It stops the local PostgreSQL cluster for a few seconds (``pg_ctlcluster``),
  so every other test using that server fails meanwhile: it runs in CI, where tests run one
  at a time. The cluster is ``DDPQ_TEST_PG_CLUSTER`` (default ``15 main``); skipped where
  ``pg_ctlcluster`` is missing or the test server is not on this machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.engine import make_url

from service.store.models import Metric

PG_CLUSTER = os.environ.get("DDPQ_TEST_PG_CLUSTER", "15 main").split()
OUTAGE_S = 5.0  # longer than the sink's flush interval (2 s), well under the lease's fence
# The API outage: well within the worker's lease fence (45 s lease: the fence ~26 s after the
# last heartbeat), with room for the API's restart on a loaded box.
API_OUTAGE_S = 10.0


def pg_ctl(action: str) -> None:
    subprocess.run(["pg_ctlcluster", *PG_CLUSTER, action], check=True, timeout=120)


def loss_rows(dep: Any, job_id: int) -> tuple[list[int], int]:
    """``(sorted distinct steps, row count)`` of the job's ``loss`` metric."""
    with dep.db.session(write=False) as s:
        where = (Metric.job_id == job_id, Metric.name == "loss")
        steps = sorted(s.scalars(select(Metric.step).where(*where)).all())
        rows = s.scalar(select(func.count()).select_from(Metric).where(*where))
    return steps, int(rows or 0)


@pytest.mark.slow
@pytest.mark.lease(45)
@pytest.mark.serial  # it restarts the PostgreSQL every other test uses
def test_postgres_restart_mid_job(pg_deployment: Any) -> None:
    dep = pg_deployment
    host = make_url(dep.settings.resolved_database_url).host
    if shutil.which("pg_ctlcluster") is None or host not in ("127.0.0.1", "localhost"):
        pytest.skip("needs the local PostgreSQL cluster and pg_ctlcluster")
    worker = dep.start_worker()
    spec = dep.load_example(
        "regression",
        config={"sleep_per_step_ms": 100},
        training={"epochs": 12, "checkpoint_every_steps": 20, "keep_checkpoints": 2},
    )
    job_id = dep.submit(spec)
    dep.wait_state(job_id, ("running",), 120)
    dep.wait_for(lambda: loss_rows(dep, job_id)[1] > 0, 90, "the first losses")

    pg_ctl("stop")
    try:
        time.sleep(OUTAGE_S)  # training goes on; rank 0 and the worker retry
    finally:
        pg_ctl("start")
    stopped_at = loss_rows(dep, job_id)[0][-1]

    job = dep.wait_state(job_id, ("succeeded",), 240)
    assert job["attempt"] == 1, "a short outage must not cost the attempt (lease renewed)"
    total = job["progress"]["total_steps"]
    steps, rows = loss_rows(dep, job_id)
    assert steps == list(range(1, total + 1)) and rows == total, (
        f"each step's loss exactly once: {rows} rows, missing "
        f"{sorted(set(range(1, total + 1)) - set(steps))[:20]}"
    )
    assert stopped_at < total, "the outage should have hit the job mid-training"
    assert worker.popen.poll() is None, f"the worker died:\n{worker.output()}"
    rank0 = (dep.artifact_dir / "jobs" / str(job_id) / "attempt-1" / "rank-0.log").read_text()
    assert "metrics writer: attempt API back" in rank0, "rank 0 should have ridden out the outage"
    assert "API unavailable" in worker.output(), "the worker saw the API's 503s and retried"
    assert "lease not renewed" not in worker.output()


def loss_times(dep: Any, job_id: int) -> list[tuple[int, float]]:
    """``(step, report time in epoch seconds)`` of the job's losses (a flush's time)."""
    with dep.db.session(write=False) as s:
        where = (Metric.job_id == job_id, Metric.name == "loss")
        rows = s.execute(select(Metric.step, Metric.time).where(*where)).all()
    return sorted((step, at.timestamp()) for step, at in rows)


def steps_per_s(times: list[tuple[int, float]], start_s: float, end_s: float) -> float:
    """Steps whose loss was flushed within ``[start_s, end_s)``, per second."""
    return sum(1 for _, at in times if start_s <= at < end_s) / (end_s - start_s)


@pytest.mark.slow
@pytest.mark.lease(45)
def test_api_down_for_10_s_mid_job(deployment: Any) -> None:
    dep = deployment
    worker = dep.start_worker()
    spec = dep.load_example(
        "regression",
        config={"sleep_per_step_ms": 100},
        # 450 steps (16 a epoch): the job must outlast the outage and the API's restart,
        # which a loaded box makes slow, so its last checkpoint finds the API back.
        training={"epochs": 30, "max_steps": 450, "checkpoint_every_steps": 50},
    )
    job_id = dep.submit(spec)
    dep.wait_state(job_id, ("running",), 120)
    dep.wait_for(lambda: len(loss_rows(dep, job_id)[0]) >= 40, 120, "40 steps' losses")

    argv = [str(a) for a in dep.api.popen.args]
    before_s = time.time()
    dep.api.stop()
    down_s = time.time()
    time.sleep(API_OUTAGE_S)  # training goes on; rank 0 holds and retries
    up_s = time.time()
    held = loss_rows(dep, job_id)[0][-1]
    dep.api = dep._spawn("api", argv)  # the same port: what a restart of `ddpq serve` does
    dep.wait_for(dep._ready, 90, "the API to answer again")

    job = dep.wait_state(job_id, ("succeeded",), 300)
    assert job["attempt"] == 1, (
        f"an API outage must not cost the attempt: {dep.events(job_id)}\n{worker.output()}"
    )
    total = job["progress"]["total_steps"]
    steps, rows = loss_rows(dep, job_id)
    assert steps == list(range(1, total + 1)) and rows == total, (
        f"each step's loss exactly once: {rows} rows, missing "
        f"{sorted(set(range(1, total + 1)) - set(steps))[:20]}"
    )
    assert held < total, "the outage should have hit the job mid-training"
    times = loss_times(dep, job_id)
    first_s = times[0][1]
    normal = steps_per_s(times, first_s, before_s)
    during = steps_per_s(times, down_s + 2.0, up_s)  # a flush's slack at the start
    assert during >= 0.8 * normal, (
        f"training slowed during the outage: {during:.1f} steps/s vs {normal:.1f} before"
    )
    assert worker.popen.poll() is None, f"the worker died:\n{worker.output()}"
    rank0 = (dep.artifact_dir / "jobs" / str(job_id) / "attempt-1" / "rank-0.log").read_text()
    assert "metrics writer: attempt API back" in rank0, "rank 0 should have ridden it out"
    # The worker reaches only the API: it retried through the outage and renewed its leases
    # after it, without stopping the ranks or moving the job.
    output = worker.output()
    assert "API unavailable" in output and "ticks succeed again" in output, output[-3000:]
    assert "lease not renewed" not in output
    events = dep.events(job_id)
    moves = [(e["from_state"], e["to_state"]) for e in events if e["from_state"] != e["to_state"]]
    assert moves == [(None, "queued"), ("queued", "starting"), ("starting", "running"),
                     ("running", "succeeded")], moves  # fmt: skip
