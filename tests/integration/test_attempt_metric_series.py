"""Metric batches in columns (``MetricSeries``) through the real app, on SQLite and
PostgreSQL: each point stored once however often the batch is resent, a bad point refused
alone, a malformed body a 422 that names the field, a superseded attempt a 409, and only the
attempt's own token let in."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.core.config import Settings
from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.core.wire import attempt as wire
from service.store.auth.tokens import WORKER, create_token
from service.store.db import Database
from tests.integration.test_attempt_api import bearer, mint, move, start_jobs

API = API_PREFIX
T0 = 1.7e9


@pytest.fixture
def app_settings(settings: Settings) -> Settings:
    """What this module's ``api`` serves (tests/conftest.py): auth on."""
    return settings.model_copy(update={"auth": "on"})


def series(name: str, steps: list[int], values: list[Any], **more: Any) -> dict[str, Any]:
    """One ``MetricSeries`` body, each point at ``T0 + step`` seconds."""
    return {"name": name, "steps": steps, "values": values,
            "times_s": [T0 + s for s in steps], **more}  # fmt: skip


def post(api: TestClient, headers: dict[str, str], body: Any) -> Any:
    return api.post(API + wire.METRICS_PATH, json=body, headers=headers)


def points(api: TestClient, headers: dict[str, str], job_id: int, name: str) -> list[Any]:
    r = api.get(f"{API}/jobs/{job_id}/metrics", params={"name": name}, headers=headers)
    assert r.status_code == 200, r.text
    return [(p["step"], p["value"], p["epoch"]) for p in r.json()["points"]]


def test_series_are_stored_once_and_a_resend_inserts_nothing(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    a = start_jobs(api, db, {"alice": users["alice"]})["alice"]
    rank = bearer(mint(db, a))
    batch = {
        "series": [
            series("loss", [1, 2, 3, 4], [1.5, None, "Infinity", -0.0], epochs=[0, 0, 1, 1]),
            series("acc", [2, 4], [0.25, 0.5], ranks=2),  # epochs left off: null
        ],
        "points": [["lr", 4, 1, 0.1, T0 + 4]],  # rows still land beside series
        "progress": {"step": 4, "total_steps": 10},
    }
    r = post(api, rank, batch)
    assert r.status_code == 200, r.text
    assert r.json() == {"accepted": 7, "inserted": 7, "refused": []}
    again = post(api, rank, batch).json()
    assert (again["accepted"], again["inserted"]) == (7, 0), "a resent batch inserts 0"
    alice = users["alice"]
    assert points(api, alice, a, "loss") == [
        (1, 1.5, 0), (2, None, 0), (3, "Infinity", 1), (4, 0.0, 1),
    ], "NaN, inf and -0.0 stored as rows store them"  # fmt: skip
    assert points(api, alice, a, "acc") == [(2, 0.25, None), (4, 0.5, None)]
    assert points(api, alice, a, "lr") == [(4, 0.1, 1)]
    job = api.get(f"{API}/jobs/{a}", headers=alice).json()
    assert job["latest_metrics"] == {"loss": 0.0, "acc": 0.5, "lr": 0.1}, job["latest_metrics"]
    assert job["progress"]["step"] == 4, job["progress"]
    # The rollups were kept in the same write: a downsampled curve reads them.
    r = api.get(f"{API}/jobs/{a}/metrics", params={"name": "acc", "max_points": 10},
                headers=alice)  # fmt: skip
    assert [(p["step"], p["value"]) for p in r.json()["points"]] == [(2, 0.25), (4, 0.5)]


def test_a_bad_point_of_a_series_is_refused_alone(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    a = start_jobs(api, db, {"alice": users["alice"]})["alice"]
    rank = bearer(mint(db, a))
    batch = {
        "series": [
            {"name": "loss", "steps": [1, 0, 3, 4, 5, 6], "values": [1.0, 2.0, "NaN", 4.0, 5, 6],
             "times_s": [T0, T0, T0, 1e300, T0, T0], "epochs": [0, 0, 0, 0, 2**40, None]},
            series("x" * 101, [1], [1.0]),  # a name too long: its every point
        ]
    }  # fmt: skip
    r = post(api, rank, batch)
    assert r.status_code == 200, r.text
    ack = r.json()
    assert (ack["accepted"], ack["inserted"]) == (2, 2), ack
    refused = [m.split(":")[0] for m in ack["refused"]]
    assert refused == [
        "series 0 point 1", "series 0 point 2", "series 0 point 3", "series 0 point 4",
        "series 1 point 0",
    ], ack["refused"]  # fmt: skip
    assert "step 0" in ack["refused"][0], "the reason names what is wrong"
    assert points(api, users["alice"], a, "loss") == [(1, 1.0, 0), (6, 6.0, None)]


@pytest.mark.parametrize(
    ("body", "loc", "words"),
    [
        ({"series": [series("loss", [1, 2], [1.0])]}, ["series", 0], "values has 1 items"),
        ({"series": [{**series("loss", [1], [1.0]), "epochs": [0, 0]}]}, ["series", 0],
         "epochs has 2 items"),
        ({"series": [{**series("loss", [1, 2], [1.0, 2.0]), "steps": [1, "x"]}]},
         ["series", 0, "steps", 1], ""),
        ({"series": [{**series("loss", [1], [1.0]), "unit": "s"}]}, ["series", 0, "unit"], ""),
        ({"series": [{"name": "loss", "steps": [1], "values": [1.0]}]},
         ["series", 0, "times_s"], ""),
        ({"series": [series("loss", list(range(1, wire.MAX_BATCH_ROWS + 1)),
                            [1.0] * wire.MAX_BATCH_ROWS),
                     series("acc", [1], [1.0])]}, [], "send at most"),
    ],
)  # fmt: skip
def test_a_malformed_series_is_a_422_naming_the_field(
    api: TestClient,
    db: Database,
    users: dict[str, dict[str, str]],
    body: dict[str, Any],
    loc: list[Any],
    words: str,
) -> None:
    a = start_jobs(api, db, {"alice": users["alice"]})["alice"]
    r = post(api, bearer(mint(db, a)), body)
    assert r.status_code == 422, r.text
    errors = r.json()["detail"]
    assert any(e["loc"] == loc and words in e["msg"] for e in errors), (
        f"expected an error at {loc} saying {words!r}, got {errors}"
    )
    assert points(api, users["alice"], a, "loss") == [], "nothing of a malformed body is stored"


def test_a_superseded_attempt_gets_409_even_with_its_token_known(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    a = start_jobs(api, db, {"alice": users["alice"]})["alice"]
    rank = bearer(mint(db, a))
    assert post(api, rank, {"series": [series("loss", [1], [1.0])]}).status_code == 200
    move(db, a, JobState.STARTING, JobState.QUEUED)  # requeued: attempt 2
    r = post(api, rank, {"series": [series("loss", [2], [2.0])]})
    assert r.status_code == 409, r.text
    assert r.json()["detail"].startswith(wire.ATTEMPT_SUPERSEDED), r.text
    assert points(api, users["alice"], a, "loss") == [(1, 1.0, None)], "nothing more stored"


def test_only_the_attempts_own_token_opens_the_route(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    ids = start_jobs(api, db, users)
    a, b = ids["alice"], ids["bob"]
    with db.session() as s:
        worker = bearer(create_token(s, owner="ops", kind=WORKER, name="w")[1])
    body = {"series": [series("loss", [1], [1.0])]}
    forged = bearer(wire.ATTEMPT_TOKEN_PREFIX + "x" * 43)
    callers = {"no token": {}, "a user token": users["alice"], "a worker token": worker,
               "an unknown attempt token": forged}  # fmt: skip
    for who, headers in callers.items():
        r = post(api, headers, body)
        assert r.status_code == 401, f"{who}: {r.status_code} {r.text}"
        assert r.headers["WWW-Authenticate"].startswith("Bearer"), who
    # Another attempt's token writes that attempt's own job, never this one.
    r = post(api, bearer(mint(db, b)), body)
    assert r.status_code == 200, r.text
    assert points(api, users["alice"], a, "loss") == []
    assert points(api, users["bob"], b, "loss") == [(1, 1.0, None)]
