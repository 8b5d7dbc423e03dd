"""A job Slurm keeps pending, through a real worker and the real dev Slurm cluster: the worker
asks squeue why (one call for all its pending jobs) and records each new reason; GET
/jobs/{id} explains it in plain words, and the job's events keep the history."""

from __future__ import annotations

import subprocess
from typing import Any

import httpx
import pytest

from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.store.jobs import crud as jobs
from tests.slurm.conftest import SlurmDb, job_row, running_worker, submit
from tests.waiting import wait_until

pytestmark = pytest.mark.slurm

SPEC: dict[str, Any] = {
    "task": "regression",
    "backend": "gloo",
    "resources": {"nnodes": 1, "nproc_per_node": 1, "timeout_min": 5},
    "training": {"max_steps": 5},
    # Slurm will not start it for an hour: pending with reason BeginTime.
    "slurm": {"extra": {"begin": "now+1hour"}},
}


def test_a_job_held_by_slurm_says_why_in_plain_words(slurm_db: SlurmDb) -> None:
    settings, db = slurm_db
    job_id = submit(db, settings, SPEC)
    api = f"{settings.api_url}{API_PREFIX}/jobs/{job_id}"

    def scheduler(code: str) -> dict[str, Any] | None:
        body = httpx.get(api, timeout=10).json()
        wait = (body.get("queue") or {}).get("scheduler")
        return body if wait and wait["code"] == code else None

    with running_worker(settings):
        body = wait_until(lambda: scheduler("BeginTime"), 60, "Slurm's reason BeginTime")
        sid = job_row(db, job_id).scheduler_job_id
        assert body["state"] == JobState.STARTING.value and sid
        assert body["queue_reason"] == (
            f"Slurm job {sid} is pending: its requested start time has not come yet "
            "(Slurm's reason: BeginTime)"
        )
        subprocess.run(["scontrol", "hold", sid], check=True, timeout=20)
        body = wait_until(
            lambda: scheduler("JobHeldAdmin") or scheduler("JobHeldUser"), 60, "a held job"
        )
        assert "held by" in body["queue"]["scheduler"]["text"]
        assert "`scontrol release <id>` lets it go" in body["queue_reason"]
        with db.session() as s:
            jobs.cancel_job(s, job_id)
        wait_until(lambda: job_row(db, job_id).state == JobState.CANCELLED.value, 30, "cancel")
    events = httpx.get(f"{api}/events", timeout=10).json()["events"]
    pending = [e["reason"] for e in events if (e["reason"] or "").startswith("scheduler pending")]
    assert pending[0].startswith("scheduler pending: BeginTime — ") and len(pending) == 2, pending
