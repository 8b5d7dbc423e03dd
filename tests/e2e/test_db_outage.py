"""PostgreSQL restarted mid-job: training goes on, the job succeeds, every step's loss is stored
exactly once, and the worker lives through it.

It stops the local PostgreSQL cluster for a few seconds (``pg_ctlcluster``), so every other
test using that server fails meanwhile: it runs in CI, where tests run one at a time. The
cluster is ``DDPQ_TEST_PG_CLUSTER`` (default ``15 main``); skipped where ``pg_ctlcluster`` is
missing or the test server is not on this machine.
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
OUTAGE_S = 5.0  # longer than the sink's flush interval (2 s), well under the lease (15 s)


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
    assert "metrics writer: database back" in rank0, "rank 0 should have ridden out the outage"
    assert "database unavailable" in worker.output()
