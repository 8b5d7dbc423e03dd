"""Why a job waits, with a real API server, a real worker process and a real rank: a job
waiting for GPUs no worker has, and one behind three higher-priority jobs while the worker's
only slot runs a job — each explained by GET /jobs/{id}; and a CPU job with more ranks than
the worker's cores is noted in its events."""

from __future__ import annotations

import os
from typing import Any

SLEEPY = {"config": {"sleep_per_step_ms": 200}, "training": {"epochs": 100}}


def test_gpus_no_worker_has_and_three_higher_priority_jobs_ahead(deployment: Any) -> None:
    dep = deployment
    dep.start_worker(slots=1)
    busy = dep.submit(dep.load_example("regression", **SLEEPY, priority=100))
    dep.wait_state(busy, ("running",), 120)
    gpu_spec = dep.load_example(
        "regression", resources={"nproc_per_node": 1, "gpus_per_node": 1}, backend="gloo"
    )
    answer = dep.http.post("/jobs", json=gpu_spec)
    assert answer.status_code == 201, answer.text
    assert answer.json()["warnings"], "no registered worker has a GPU: flagged at submit"
    gpu = dep.job(answer.json()["id"])
    assert (
        gpu["queue_reason"] == "waiting for a worker with 1 free GPU (live workers have at most 0)"
    )
    (fit,) = gpu["queue"]["workers"]
    assert (
        fit["live"]
        and not fit["can_ever"]
        and fit["why_not"] == ["has 0 GPUs; the job needs 1 per node"]
    )
    ahead = [dep.submit(dep.load_example("regression", priority=5)) for _ in range(3)]
    mine = dep.submit(dep.load_example("regression", priority=1))
    queue = dep.job(mine)["queue"]
    assert queue["position"] == 4 and [a["id"] for a in queue["ahead"]] == ahead
    assert queue["summary"] == "waiting for a free slot (1 live worker, all busy)"
    assert queue["workers"][0]["why_not"] == ["all 1 slot busy"]
    for job_id in (busy, *ahead, mine, gpu["id"]):
        dep.http.post(f"/jobs/{job_id}/cancel")
    dep.wait_state(busy, ("cancelled",), 30)


def test_more_ranks_than_cores_is_an_event(deployment: Any) -> None:
    dep = deployment
    dep.start_worker()
    cores = len(os.sched_getaffinity(0))
    spec = dep.load_example("regression", resources={"nproc_per_node": cores + 1},
                            training={"max_steps": 2})  # fmt: skip
    job_id = dep.submit(spec)
    dep.wait_state(job_id, ("succeeded", "failed"), 180)
    notes = [e["reason"] for e in dep.events(job_id) if e["from_state"] == e["to_state"]]
    assert any(n.startswith(f"{cores + 1} ranks on {cores} CPU core") for n in notes), notes
