"""The digits example (2 ranks, gloo, CPU) end to end: submitted over HTTP, trained by a real
worker, metrics and checkpoints checked through the API."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest


@pytest.mark.slow
def test_digits_example_succeeds_with_accuracy_and_checkpoints(deployment: Any) -> None:
    dep = deployment
    dep.start_worker()
    job_id = dep.submit(dep.load_example("digits"))
    job = dep.wait_state(job_id, ("succeeded",), 600)
    http = dep.http

    accuracy = job["latest_metrics"]["eval_accuracy"]
    assert accuracy >= 0.95, f"eval_accuracy {accuracy} < 0.95"

    last_step = job["progress"]["step"]
    assert last_step == job["progress"]["total_steps"] > 0
    r = http.get(f"/jobs/{job_id}/metrics", params={"name": "loss", "limit": 10_000})
    assert r.status_code == 200, r.text
    steps = [p["step"] for p in r.json()["points"]]
    assert steps == list(range(1, last_step + 1)), "expected exactly one loss row per step"

    checkpoints = http.get(f"/jobs/{job_id}/checkpoints").json()["checkpoints"]
    assert checkpoints, "the job recorded no checkpoint"
    assert max(c["step"] for c in checkpoints) == last_step, "no checkpoint at the end"
    for c in checkpoints:
        r = http.get(f"/jobs/{job_id}/checkpoints/{c['step']}/file")
        assert r.status_code == 200, r.text
        assert len(r.content) == c["size_bytes"]
        assert hashlib.sha256(r.content).hexdigest() == c["sha256"], f"step {c['step']}"
    assert dep.processes(job_id) == []
