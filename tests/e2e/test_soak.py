"""Soak: two workers, 8 short DDP jobs (``DDPQ_SOAK_JOBS`` for more), one worker SIGKILLed at
a random moment.

Every job must end ``succeeded`` with each step's loss stored once, and no job may ever have
processes of two attempts alive at the same time. The last is observed, not inferred: a
sampler thread reads ``DDPQ_JOB_ID``/``DDPQ_ATTEMPT`` from ``/proc/*/environ`` of every process
of the deployment every 50 ms for the whole run.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from service.store.models import Metric

JOBS = int(os.environ.get("DDPQ_SOAK_JOBS", "8"))
STEPS = 8


def _job_attempt(pid: str, needle: bytes) -> tuple[int, int] | None:
    """(job id, attempt) of a process of this deployment's attempts, else None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    if needle not in env:
        return None
    keys = dict(item.split(b"=", 1) for item in env if b"=" in item)
    job, attempt = keys.get(b"DDPQ_JOB_ID"), keys.get(b"DDPQ_ATTEMPT")
    return (int(job), int(attempt)) if job and attempt else None


class _Sampler(threading.Thread):
    """Records every moment a job had processes of more than one attempt alive (torchrun or
    rank), from ``/proc/*/environ`` every 50 ms.

    A process's environment is fixed once it runs, so an attempt's process is read once; any
    other process is read again every ``RECHECK_SAMPLES`` samples only (it may have been read
    between fork and exec). Reading every process every time costs a core on a busy box."""

    RECHECK_SAMPLES = 20

    def __init__(self, artifact_dir: Path) -> None:
        super().__init__(daemon=True)
        self.needle = f"DDPQ_ARTIFACT_DIR={artifact_dir}".encode()
        self.overlaps: list[tuple[int, set[int]]] = []
        self.samples = 0
        self.done = threading.Event()
        self.ours: dict[str, tuple[int, int]] = {}
        self.foreign: dict[str, int] = {}  # pid → the sample it was last read at

    def attempts_alive(self) -> dict[int, set[int]]:
        """job id → attempts that have a live process right now."""
        pids = {p for p in os.listdir("/proc") if p.isdigit()}
        for gone in set(self.ours) - pids:
            del self.ours[gone]
        for pid in pids - set(self.ours):
            last = self.foreign.get(pid)
            if last is not None and self.samples - last < self.RECHECK_SAMPLES:
                continue
            found = _job_attempt(pid, self.needle)
            if found is None:
                self.foreign[pid] = self.samples
            else:
                self.ours[pid] = found
                self.foreign.pop(pid, None)
        alive: dict[int, set[int]] = defaultdict(set)
        for job, attempt in self.ours.values():
            alive[job].add(attempt)
        return alive

    def run(self) -> None:
        while not self.done.is_set():
            for job, attempts in self.attempts_alive().items():
                if len(attempts) > 1:
                    self.overlaps.append((job, attempts))
            self.samples += 1
            time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_many_jobs_two_workers_one_killed(pg_deployment: Any) -> None:
    dep = pg_deployment
    rng = random.Random(os.environ.get("DDPQ_SOAK_SEED", "6"))
    workers = [dep.start_worker(), dep.start_worker()]
    sampler = _Sampler(dep.artifact_dir)
    sampler.start()
    spec = dep.load_example(
        "regression",
        config={"sleep_per_step_ms": 40},
        training={"epochs": 1, "max_steps": STEPS, "checkpoint_every_steps": 3},
    )
    ids = [dep.submit({**spec, "name": f"soak-{i}"}) for i in range(JOBS)]

    # After a random number of jobs finished, SIGKILL a worker that is running a job then.
    kill_after = rng.randint(3, JOBS // 2)

    def finished() -> int:
        r = dep.http.get("/jobs", params={"state": "succeeded", "limit": 200})
        return len(r.json()["jobs"])

    def busy_worker() -> Any:
        running = dep.http.get("/jobs", params={"state": "running", "limit": 200}).json()["jobs"]
        holders = {str(job["worker_id"]).split("-")[-2] for job in running if job["worker_id"]}
        busy = [w for w in workers if str(w.popen.pid) in holders]
        return rng.choice(busy) if busy else None

    dep.wait_for(lambda: finished() >= kill_after, 600, f"{kill_after} jobs to finish", 0.5)
    victim = dep.wait_for(busy_worker, 120, "a worker running a job", 0.05)
    victim.signal(signal.SIGKILL)
    victim.popen.wait(10)

    try:
        for job_id in ids:
            job = dep.wait_state(job_id, ("succeeded",), 600)
            assert job["progress"]["step"] == STEPS, job
    finally:
        sampler.done.set()
        sampler.join(5)

    assert sampler.samples > 100, "the sampler must really have watched the run"
    assert sampler.overlaps == [], f"two attempts of one job alive at once: {sampler.overlaps[:5]}"
    with dep.db.session(write=False) as s:
        rows = s.execute(
            select(Metric.job_id, func.count(), func.min(Metric.step), func.max(Metric.step))
            .where(Metric.job_id.in_(ids), Metric.name == "loss")
            .group_by(Metric.job_id)
        ).all()
    # (job, name, step) is the primary key, so no step is stored twice; none may be missing.
    assert {job: (n, lo, hi) for job, n, lo, hi in rows} == {
        job: (STEPS, 1, STEPS) for job in ids
    }, "each job: one loss row for every step"
    attempts = [dep.job(job_id)["attempt"] for job_id in ids]
    assert max(attempts) >= 2, "the killed worker's job should have been rerun as attempt 2"
