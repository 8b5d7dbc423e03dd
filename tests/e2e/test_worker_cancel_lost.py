"""An accepted cancel survives the worker that should have acted on it: a worker frozen then
SIGKILLed (the reaper must cancel, not requeue) or stopped with SIGTERM right after the cancel
(its shutdown must cancel, not requeue "worker stopped")."""

from __future__ import annotations

import signal
import sqlite3
import time
from typing import Any

import pytest

LOST = "cancel requested (instead of: worker lost: lease expired)"
STOPPED = "cancel requested (instead of: worker stopped)"


def _running_job(dep: Any) -> int:
    spec = dep.load_example(
        "regression", config={"sleep_per_step_ms": 100}, training={"epochs": 100}
    )
    job_id: int = dep.submit(spec)
    dep.wait_state(job_id, ("running",), 120)
    dep.wait_for(lambda: len(dep.processes(job_id)) >= 3, 90, "torchrun and 2 ranks")
    return job_id


def _freeze(dep: Any, worker: Any) -> None:
    """SIGSTOP ``worker`` at a moment it holds no SQLite write lock. Frozen inside a write
    transaction it would block every other writer (the API's cancel) until it runs again:
    SQLite's nature, not what these tests are about (a CI run hit it once)."""
    path = dep.db.engine.url.database
    for _ in range(100):
        worker.signal(signal.SIGSTOP)
        probe = sqlite3.connect(path, timeout=0.5, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
            return
        except sqlite3.OperationalError:  # locked: by the worker, or by a rank's brief write
            worker.signal(signal.SIGCONT)
            time.sleep(0.05)
        finally:
            probe.close()
    raise AssertionError("the worker held the database write lock at every try")


def _cancel(dep: Any, job_id: int) -> None:
    r = dep.http.post(f"/jobs/{job_id}/cancel")
    assert r.status_code == 202, r.text
    assert r.json()["cancel_requested"] is True, r.json()


@pytest.mark.slow
def test_cancel_accepted_while_the_worker_is_frozen_then_killed(deployment: Any) -> None:
    dep = deployment
    first = dep.start_worker()
    job_id = _running_job(dep)
    _freeze(dep, first)
    _cancel(dep, job_id)
    first.signal(signal.SIGKILL)
    first.popen.wait(30)
    dep.wait_for(lambda: not dep.processes(job_id), 60, "the ranks to die with the worker")
    dep.start_worker()  # its reaper finds the expired lease (15 s)
    job = dep.wait_state(job_id, ("cancelled",), 120)
    assert job["attempt"] == 1, f"the job was requeued and run again: {job}"
    events = dep.events(job_id)
    assert events[-1]["reason"] == LOST, events
    assert [e["to_state"] for e in events].count("starting") == 1, "claimed a second time"


@pytest.mark.slow
def test_cancel_accepted_just_before_the_worker_is_stopped(deployment: Any) -> None:
    dep = deployment
    first = dep.start_worker()
    job_id = _running_job(dep)
    _freeze(dep, first)  # no heartbeat can tell it of the cancel before the SIGTERM
    _cancel(dep, job_id)
    first.signal(signal.SIGTERM)
    first.signal(signal.SIGCONT)
    assert first.popen.wait(60) == 0, first.output()
    job = dep.job(job_id)
    assert (job["state"], job["attempt"]) == ("cancelled", 1), job
    assert dep.events(job_id)[-1]["reason"] in (STOPPED, "cancel requested")
    assert dep.processes(job_id) == []
