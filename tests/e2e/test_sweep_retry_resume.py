"""Retry-failed with a real local worker and real ranks: the retried trial continues from
its failed job's newest checkpoint (its first step is the one after it), not from step 1."""

from __future__ import annotations

from typing import Any

import pytest

TERMINAL = ("succeeded", "failed", "cancelled")


@pytest.mark.slow
def test_a_retried_trial_continues_after_its_checkpoint(deployment: Any) -> None:
    dep = deployment
    http = dep.http
    dep.start_worker(slots=1)
    # Checkpoints at steps 3 and 6, the injected failure at step 8 (every run of the spec).
    body = {
        "name": "resume",
        "base": {
            "name": "r",
            "task": "regression",
            "config": {"fail_at_step": 8, "sleep_per_step_ms": 200},
            "training": {"max_steps": 12, "checkpoint_every_steps": 3, "log_every_steps": 1},
        },
        "axes": {"config.hidden": {"grid": [8]}},
    }
    r = http.post("/sweeps", json=body)
    assert r.status_code == 201, r.text
    sweep_id = r.json()["id"]

    def ended() -> dict[str, Any] | None:
        sweep: dict[str, Any] = http.get(f"/sweeps/{sweep_id}").json()
        return sweep if sweep["state"] in TERMINAL else None

    dep.wait_for(ended, 600, "the sweep to end", every_s=1.0)
    (before,) = http.get(f"/sweeps/{sweep_id}/trials").json()["trials"]
    assert before["outcome"] == "failed", dep.diagnostics(before["job_id"])
    failed_id = before["job_id"]
    ckpts = http.get(f"/jobs/{failed_id}/checkpoints").json()["checkpoints"]
    newest = max(c["step"] for c in ckpts)
    assert newest in (3, 6), ckpts

    r = http.post(f"/sweeps/{sweep_id}/retry-failed")
    assert r.status_code == 200 and r.json()["added"] == 1, r.text
    dep.wait_for(ended, 600, "the retried sweep to end", every_s=1.0)
    (after,) = http.get(f"/sweeps/{sweep_id}/trials").json()["trials"]
    retried = dep.job(after["job_id"])
    assert retried["spec"]["init_from"]["job"] == failed_id
    assert retried["spec"]["init_from"]["step"] == newest
    points = http.get(f"/jobs/{retried['id']}/metrics", params={"name": "loss"}).json()["points"]
    first = min(p["step"] for p in points)
    assert first == newest + 1, (
        f"the retried trial started at step {first}, not after its checkpoint at {newest}: "
        f"{dep.diagnostics(retried['id'])}"
    )
    # The failure is in the spec (step 8), so it fails again: continued, not fixed.
    assert retried["state"] == "failed" and after["attempts"] == 2
