"""A sweep's curves over the real app on SQLite and PostgreSQL: every trial's history of one
metric in one call, downsampled per trial (the first and last point and each bucket's
minimum and maximum kept, with their own steps), NaN/inf JSON-safe, the names, and who may
read them."""

from __future__ import annotations

import random
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.core.config import Settings
from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.store.attempts.tokens import mint_attempt_token
from service.store.auth.tokens import create_token
from service.store.db import Database
from service.store.jobs import crud as jobs
from service.store.metrics.points import MetricPoint, record_metrics
from service.store.sweeps.metrics import sweep_curves

API = API_PREFIX
SWEEP: dict[str, Any] = {
    "name": "lr",
    "base": {"name": "b", "task": "regression", "training": {"max_steps": 5}},
    "axes": {"training.lr": {"grid": [0.001, 0.01, 0.1]}},
}


def start(db: Database, job_id: int) -> None:
    """Move a queued trial to running (attempt 1), as a worker would."""
    with db.session() as s:
        jobs.apply_transition(s, jobs.Transition(job_id, JobState.QUEUED, JobState.STARTING))
        jobs.apply_transition(s, jobs.Transition(job_id, JobState.STARTING, JobState.RUNNING))


def report(db: Database, job_id: int, name: str, values: dict[int, float]) -> None:
    """Record ``values`` ({step: value}) of ``name`` for attempt 1."""
    points = [MetricPoint(name=name, step=s, value=v) for s, v in values.items()]
    with db.session() as s:
        record_metrics(s, job_id, 1, points)


def submit(api: TestClient, **headers: Any) -> tuple[int, list[dict[str, Any]]]:
    r = api.post(f"{API}/sweeps", json=SWEEP, **headers)
    assert r.status_code == 201, r.text
    sweep_id = int(r.json()["id"])
    rows = api.get(f"{API}/sweeps/{sweep_id}/trials", **headers).json()["trials"]
    return sweep_id, rows


def expected_steps(values: dict[int, float], max_points: int) -> set[int]:
    """The steps the decimation must keep: both ends and each bucket's argmin and argmax."""
    lo, hi = min(values), max(values)
    buckets = (max_points - 2) // 2
    by_bucket: dict[int, list[int]] = {}
    for step in values:
        by_bucket.setdefault((step - lo) * buckets // (hi - lo + 1), []).append(step)
    keep = {lo, hi}
    for steps in by_bucket.values():
        keep.add(min(steps, key=lambda s: values[s]))
        keep.add(max(steps, key=lambda s: values[s]))
    return keep


def test_all_trials_curves_in_one_call_downsampled_per_trial(api: TestClient, db: Database) -> None:
    sweep_id, rows = submit(api)
    long_id, short_id, silent_id = (r["job_id"] for r in rows)
    for job_id in (long_id, short_id, silent_id):
        start(db, job_id)
    rng = random.Random(7)
    long_curve = {step: rng.uniform(0.0, 1.0) for step in range(1, 5001)}
    long_curve[1234] = 99.0  # a spike and a dip: both must survive
    long_curve[3210] = -42.0
    report(db, long_id, "loss", long_curve)
    short_curve = {1: 2.0, 2: float("nan"), 3: float("inf"), 4: 0.5}
    report(db, short_id, "loss", short_curve)
    report(db, short_id, "eval_accuracy", {4: 0.9})
    report(db, silent_id, "eval_accuracy", {1: 0.1})

    r = api.get(f"{API}/sweeps/{sweep_id}/metrics", params={"name": "loss", "max_points": 100})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["name"] == "loss"
    series = body["series"]
    assert [s["job_id"] for s in series] == [long_id, short_id], "trial order; silent left out"
    assert [s["trial_key"] for s in series] == [rows[0]["key"], rows[1]["key"]]

    long_points = series[0]["points"]
    steps = [p[0] for p in long_points]
    assert steps == sorted(steps) and len(steps) == len(set(steps)), "ascending, no repeats"
    assert len(long_points) <= 100
    assert set(steps) == expected_steps(long_curve, 100), "ends + each bucket's min and max"
    assert all(v == long_curve[s] for s, v in long_points), "values at their own steps"
    assert [1234, 99.0] in long_points and [3210, -42.0] in long_points
    # A short history comes back whole, NaN as null and inf as a string.
    assert series[1]["points"] == [[1, 2.0], [2, None], [3, "Infinity"], [4, 0.5]]

    # Enough points per trial: the long one comes back whole as well.
    r = api.get(f"{API}/sweeps/{sweep_id}/metrics", params={"name": "loss", "max_points": 5000})
    assert len(r.json()["series"][0]["points"]) == 5000
    # Another metric: only the trials that reported it.
    r = api.get(f"{API}/sweeps/{sweep_id}/metrics", params={"name": "eval_accuracy"})
    assert [(s["job_id"], s["points"]) for s in r.json()["series"]] == [
        (short_id, [[4, 0.9]]),
        (silent_id, [[1, 0.1]]),
    ]
    r = api.get(f"{API}/sweeps/{sweep_id}/metrics", params={"name": "nothing"})
    assert r.json() == {"name": "nothing", "series": []}

    names = api.get(f"{API}/sweeps/{sweep_id}/metrics/names")
    assert names.status_code == 200, names.text
    assert names.json() == {"names": ["eval_accuracy", "loss"]}


def test_sweeps_too_long_to_read_whole_are_sampled_per_bucket(
    api: TestClient, db: Database
) -> None:
    sweep_id, rows = submit(api)
    long_id, short_id = rows[0]["job_id"], rows[1]["job_id"]
    for job_id in (long_id, short_id):
        start(db, job_id)
    long_curve = {step: 1.0 / step for step in range(1, 3001)}
    report(db, long_id, "loss", long_curve)
    report(db, short_id, "loss", {1: 2.0, 2: 1.0})
    assert api.get(f"{API}/sweeps/{sweep_id}/metrics").json()["series"][0]["sampled"] is False

    with db.session(write=False) as s:
        exact = sweep_curves(s, sweep_id, "loss", max_points=50, max_scanned_points=3000)
        sampled = sweep_curves(s, sweep_id, "loss", max_points=50, max_scanned_points=2999)
    assert not exact[0].sampled and sampled[0].sampled
    assert not sampled[1].sampled and sampled[1].steps == [1, 2], "short trials stay whole"
    # The first point, the first point of each of 48 equal step buckets, and the last.
    assert sampled[0].steps == sorted({1 + k * 3000 // 48 for k in range(48)} | {3000})
    assert sampled[0].values == [long_curve[step] for step in sampled[0].steps]
    assert len(exact[0].steps) <= 50 and exact[0].steps[0] == 1 and exact[0].steps[-1] == 3000


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"max_points": 3}, "max_points"),
        ({"name": ""}, "name"),
        ({"max_points": "x"}, "max_points"),
    ],
)
def test_bad_parameters_are_422_naming_the_field(
    api: TestClient, params: dict[str, Any], field: str
) -> None:
    sweep_id, _ = submit(api)
    r = api.get(f"{API}/sweeps/{sweep_id}/metrics", params=params)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["query", field]


def test_other_owners_get_404_and_attempt_tokens_401(settings: Settings, db: Database) -> None:
    with db.session() as s:
        alice = create_token(s, owner="alice")[1]
        bob = create_token(s, owner="bob")[1]
    auth = settings.model_copy(update={"auth": "on"})
    with TestClient(create_app(auth)) as api:
        mine = {"headers": {"Authorization": f"Bearer {alice}"}}
        sweep_id, rows = submit(api, **mine)
        start(db, rows[0]["job_id"])
        report(db, rows[0]["job_id"], "loss", {1: 1.0})
        with db.session() as s:
            rank = {"Authorization": f"Bearer {mint_attempt_token(s, rows[0]['job_id'], 1)}"}
        for path in (f"/sweeps/{sweep_id}/metrics", f"/sweeps/{sweep_id}/metrics/names"):
            r = api.get(API + path, headers={"Authorization": f"Bearer {bob}"})
            assert r.status_code == 404, f"bob GET {path}: {r.status_code} {r.text}"
            assert "loss" not in r.text
            assert api.get(API + path, headers=rank).status_code == 401, "attempt token"
            assert api.get(API + path).status_code == 401, "no token"
            assert api.get(API + path, **mine).status_code == 200
        r = api.get(f"{API}/sweeps/{sweep_id}/metrics", **mine)
        assert r.json()["series"][0]["points"] == [[1, 1.0]]
