"""Sweep axes whose values cannot make distinct, finite trials are a 422 naming the axis with
nothing stored, over the real app on SQLite and PostgreSQL: a uniform range too wide to draw
from, values that validate to the same trial, a bool where a number is expected."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from service.core.wire import API_PREFIX
from service.store.db import Database
from service.store.models import Job, SweepTrial

API = API_PREFIX
BASE: dict[str, Any] = {"name": "b", "task": "regression", "training": {"max_steps": 5}}


def stored(db: Database) -> tuple[int, int]:
    with db.session(write=False) as s:
        return (
            s.scalar(select(func.count()).select_from(SweepTrial)) or 0,
            s.scalar(select(func.count()).select_from(Job)) or 0,
        )


def refused(api: TestClient, axes: dict[str, Any], samples: int = 1) -> list[dict[str, Any]]:
    body = {"name": "s", "base": BASE, "axes": axes, "samples": samples}
    r = api.post(f"{API}/sweeps", json=body)
    assert r.status_code == 422, r.text
    detail: list[dict[str, Any]] = r.json()["detail"]
    return detail


def test_a_uniform_range_too_wide_to_draw_is_422_naming_the_axis(
    api: TestClient, db: Database
) -> None:
    detail = refused(api, {"training.lr": {"uniform": [-1e308, 1e308]}}, samples=3)
    assert any("training.lr" in e["loc"] and "finite" in e["msg"] for e in detail), detail
    assert stored(db) == (0, 0)


@pytest.mark.parametrize(
    ("axes", "values"),
    [
        ({"training.lr": {"grid": [0.1, 0.1]}}, ("0.1", "0.1")),
        ({"config.hidden": {"grid": [8, "16", 16.0]}}, ('"16"', "16.0")),
    ],
)
def test_values_that_validate_to_one_trial_are_422_naming_axis_and_values(
    api: TestClient, db: Database, axes: dict[str, Any], values: tuple[str, str]
) -> None:
    (path,) = axes
    detail = refused(api, axes)
    dup = [e for e in detail if e["type"] == "duplicate_trial"]
    assert dup and dup[0]["loc"] == ["body", "axes", path], detail
    assert all(v in dup[0]["msg"] for v in values), dup
    assert stored(db) == (0, 0)


def test_a_bool_where_a_number_is_expected_is_422(api: TestClient, db: Database) -> None:
    detail = refused(api, {"config.hidden": {"grid": [8, True]}})
    assert any(e["loc"][-1] == "config.hidden" and "true/false" in e["msg"] for e in detail)
    assert stored(db) == (0, 0)


def test_trial_overrides_are_the_values_the_job_holds(api: TestClient) -> None:
    body = {"name": "s", "base": BASE, "axes": {"config.hidden": {"grid": ["8", 16]}}}
    sweep = api.post(f"{API}/sweeps", json=body).json()
    rows = api.get(f"{API}/sweeps/{sweep['id']}/trials").json()["trials"]
    assert sorted(r["overrides"]["config.hidden"] for r in rows) == [8, 16]


def test_extend_with_one_value_written_two_ways_adds_at_most_one(
    api: TestClient, db: Database
) -> None:
    body = {"name": "s", "base": BASE, "axes": {"training.lr": {"grid": [0.001]}}}
    sweep = api.post(f"{API}/sweeps", json=body).json()
    ext = {"axes": {"training.lr": {"grid": [0.01, "0.01"]}}}
    r = api.post(f"{API}/sweeps/{sweep['id']}/extend", json=ext)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "axes", "training.lr"]
    assert stored(db) == (1, 1)
    same = {"axes": {"training.lr": {"grid": ["0.001"]}}}
    r = api.post(f"{API}/sweeps/{sweep['id']}/extend", json=same)
    assert r.status_code == 200 and r.json()["added"] == 0, r.text
    assert stored(db) == (1, 1)


def test_a_misspelt_sweep_field_is_422_naming_the_field_it_meant(
    api: TestClient, db: Database
) -> None:
    body = {"name": "s", "base": BASE, "axes": {"training.lr": {"grid": [0.1]}}, "max_concurent": 2}
    r = api.post(f"{API}/sweeps", json=body)
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["body", "max_concurent"]
    assert error["msg"].endswith("did you mean 'max_concurrent'?"), error
    assert stored(db) == (0, 0), "nothing stored"
