"""Sweeps end to end with a real local worker and real ranks: a 2×2 grid × 2 seeds over
``digits`` with max_concurrent 2 on a worker with room for 3 jobs; retry-failed; ASHA."""

from __future__ import annotations

import itertools
from datetime import datetime
from typing import Any

import pytest

TERMINAL = ("succeeded", "failed", "cancelled")
LRS = [0.002, 0.01]
HIDDEN = [16, 64]


def _digits_sweep() -> dict[str, Any]:
    return {
        "name": "digits-grid",
        "base": {
            "name": "d",
            "task": "digits",
            "config": {"model": "mlp"},
            "resources": {"nproc_per_node": 1, "timeout_min": 10},
            "training": {"epochs": 1, "batch_size": 64, "log_every_steps": 5},
        },
        "axes": {"training.lr": {"grid": LRS}, "config.hidden": {"grid": HIDDEN}},
        "seeds": 2,
        "max_concurrent": 2,
    }


def _max_overlap(intervals: list[tuple[datetime, datetime]]) -> int:
    """Most intervals open at one instant (an end at t closes before a start at t)."""
    marks = sorted(
        [(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda m: (m[0], m[1])
    )
    open_now = most = 0
    for _, delta in marks:
        open_now += delta
        most = max(most, open_now)
    return most


@pytest.mark.slow
@pytest.mark.timeout(900)  # eight real digits runs, two at a time, on a loaded box
def test_grid_sweep_holds_max_concurrent_and_finds_the_best(deployment: Any) -> None:
    dep = deployment
    http = dep.http
    dep.start_worker(slots=3)
    r = http.post("/sweeps", json=_digits_sweep())
    assert r.status_code == 201, r.text
    sweep_id = r.json()["id"]

    def ended() -> dict[str, Any] | None:
        body: dict[str, Any] = http.get(f"/sweeps/{sweep_id}").json()
        return body if body["state"] in TERMINAL else None

    try:
        sweep = dep.wait_for(ended, 900, "the sweep to end", every_s=1.0)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{dep.diagnostics(0)}") from None
    trials = http.get(f"/sweeps/{sweep_id}/trials").json()["trials"]
    assert sweep["state"] == "succeeded", sweep
    assert sweep["counts"]["succeeded"] == 8 and sweep["trials_total"] == 8

    expected = [
        {"training.lr": lr, "config.hidden": h, "training.seed": s}
        for lr, h, s in itertools.product(LRS, HIDDEN, range(2))
    ]
    assert [t["overrides"] for t in trials] == expected
    intervals = []
    accuracy: dict[int, float] = {}
    for t in trials:
        job = dep.job(t["job_id"])
        assert job["state"] == "succeeded" and t["outcome"] == "succeeded"
        assert (job["sweep_id"], job["trial_key"], t["attempts"]) == (sweep_id, t["key"], 1)
        assert job["spec"]["training"]["lr"] == t["overrides"]["training.lr"]
        assert job["spec"]["config"]["hidden"] == t["overrides"]["config.hidden"]
        assert job["spec"]["training"]["seed"] == t["overrides"]["training.seed"]
        accuracy[job["id"]] = job["latest_metrics"]["eval_accuracy"]
        assert t["objective_value"] == accuracy[job["id"]]
        assert t["steps_done"] == job["progress"]["step"] > 0 and t["run_time_s"] > 0
        events = dep.events(job["id"])
        start = next(e["created_at"] for e in events if e["to_state"] == "starting")
        end = next(e["created_at"] for e in events if e["to_state"] in TERMINAL)
        intervals.append((datetime.fromisoformat(start), datetime.fromisoformat(end)))
    assert _max_overlap(intervals) == 2, (
        f"expected at most (and, with 3 slots, exactly) 2 trials at once: {intervals}"
    )
    best = sweep["best"]
    assert best["value"] == max(accuracy.values()) == accuracy[best["job_id"]], (best, accuracy)


@pytest.mark.slow
def test_retry_failed_reruns_exactly_the_two_failed_trials(deployment: Any) -> None:
    dep = deployment
    http = dep.http
    dep.start_worker(slots=2)
    # Trials with fail_at_step set fail (the regression task's fault knob): two of four.
    body = {
        "name": "retry",
        "base": {"name": "r", "task": "regression", "training": {"max_steps": 4}},
        "axes": {"config.fail_at_step": {"grid": [None, 2]}, "config.hidden": {"grid": [8, 16]}},
    }
    r = http.post("/sweeps", json=body)
    assert r.status_code == 201, r.text
    sweep_id = r.json()["id"]

    def ended() -> dict[str, Any] | None:
        sweep: dict[str, Any] = http.get(f"/sweeps/{sweep_id}").json()
        return sweep if sweep["state"] in TERMINAL else None

    sweep = dep.wait_for(ended, 600, "the sweep to end", every_s=1.0)
    assert sweep["counts"]["failed"] == 2 and sweep["counts"]["succeeded"] == 2, sweep
    before = http.get(f"/sweeps/{sweep_id}/trials").json()["trials"]
    failed = [t["key"] for t in before if t["outcome"] == "failed"]
    r = http.post(f"/sweeps/{sweep_id}/retry-failed")
    assert r.status_code == 200 and r.json()["added"] == 2, r.text
    sweep = dep.wait_for(ended, 600, "the retried sweep to end", every_s=1.0)
    after = http.get(f"/sweeps/{sweep_id}/trials").json()["trials"]
    rerun = [t["key"] for t, b in zip(after, before, strict=True) if t["job_id"] != b["job_id"]]
    assert rerun == failed, "exactly the failed trials ran again"
    assert all(t["attempts"] == 2 for t in after if t["key"] in failed)
    assert sweep["counts"]["failed"] == 2, "they fail again (same spec): a re-run, not a fix"


@pytest.mark.slow
def test_asha_stops_the_worse_trials_of_real_runs(deployment: Any) -> None:
    """One trial at a time (max_concurrent 1), best learning rate first: it sets every rung,
    and the two worse ones are stopped at the first rung while they run."""
    dep = deployment
    http = dep.http
    dep.start_worker(slots=1)
    body = {
        "name": "asha",
        "base": {
            "name": "a",
            "task": "regression",
            "config": {"sleep_per_step_ms": 150},
            "training": {"epochs": 2, "max_steps": 45, "optimizer": "adam"},
        },
        "axes": {"training.lr": {"grid": [0.05, 1e-6, 3e-6]}},
        "max_concurrent": 1,
        "early_stop": {"asha": {"rung_steps": 5, "reduction_factor": 3}},
    }
    r = http.post("/sweeps", json=body)
    assert r.status_code == 201, r.text
    sweep_id = r.json()["id"]

    def ended() -> dict[str, Any] | None:
        sweep: dict[str, Any] = http.get(f"/sweeps/{sweep_id}").json()
        return sweep if sweep["state"] in TERMINAL else None

    sweep = dep.wait_for(ended, 600, "the sweep to end", every_s=1.0)
    trials = http.get(f"/sweeps/{sweep_id}/trials").json()["trials"]
    assert [t["outcome"] for t in trials] == ["succeeded", "stopped_early", "stopped_early"], (
        trials,
        dep.diagnostics(trials[1]["job_id"]),
    )
    assert sweep["state"] == "succeeded" and sweep["best"]["job_id"] == trials[0]["job_id"]
    assert trials[0]["steps_done"] == 45, "the best trial ran to the end"
    for t in trials[1:]:
        assert t["state"] == "cancelled" and t["steps_done"] < 45
        reasons = [e["reason"] or "" for e in dep.events(t["job_id"])]
        stop = next(r for r in reasons if r.startswith("stopped at rung 0, step 5: loss "))
        assert "not in the top 1/3 (cut " in stop, stop
        points = http.get(f"/jobs/{t['job_id']}/metrics", params={"name": "loss"}).json()
        assert len(points["points"]) >= 5, "a stopped trial keeps its curve"
