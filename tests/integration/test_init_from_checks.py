"""``init_from`` checked like the real submit (real app, SQLite and PostgreSQL): a ``full``
start from a step at or past ``training.max_steps`` is refused (it would train nothing), and
``POST /jobs?dry_run=true`` runs the same resolve, showing the start or the same 422."""

from __future__ import annotations

import os
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.core.config import Settings
from service.store.db import Database
from tests.uploads import API, mint, running_job, sha, upload

CHUNK = 64 * 1024


@pytest.fixture
def app_settings(settings: Settings) -> Settings:
    """What this module's ``api`` serves (tests/conftest.py)."""
    return settings.model_copy(update={"auth": "on", "checkpoint_chunk_bytes": CHUNK})


def spec(max_steps: int | None = None, **init: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"name": "ft", "task": "regression", "init_from": init}
    if max_steps is not None:
        body["training"] = {"max_steps": max_steps}
    return body


@pytest.fixture
def source(api: TestClient, db: Database) -> tuple[int, bytes]:
    job = running_job(db, "alice")
    data = os.urandom(CHUNK + 5)
    assert upload(api, mint(db, job), data, 50, CHUNK).status_code == 201
    return job, data


def test_a_full_start_with_nothing_left_to_train_is_refused_at_submit(
    api: TestClient, users: dict[str, dict[str, str]], source: tuple[int, bytes]
) -> None:
    job, _ = source
    for max_steps in (50, 10):
        r = api.post(f"{API}/jobs", json=spec(max_steps, job=job, mode="full"),
                     headers=users["alice"])  # fmt: skip
        assert r.status_code == 422, r.text
        (err,) = r.json()["detail"]
        assert err["loc"] == ["body", "init_from", "step"], err
        assert f"training.max_steps {max_steps}" in err["msg"]
    ok = [spec(51, job=job, mode="full"), spec(10, job=job), spec(job=job, mode="full")]
    for body in ok:  # steps left; weights only (steps count from 0); total not known yet
        r = api.post(f"{API}/jobs", json=body, headers=users["alice"])
        assert r.status_code == 201, f"{body}: {r.text}"


def test_dry_run_resolves_init_from_as_the_submit_does(
    api: TestClient, users: dict[str, dict[str, str]], source: tuple[int, bytes]
) -> None:
    job, data = source
    url = f"{API}/jobs?dry_run=true"
    r = api.post(url, json=spec(job=job), headers=users["alice"])
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["init_from"] == {"job": job, "step": 50, "sha256": sha(data),
                                   "mode": "weights_only"}  # fmt: skip
    assert answer["spec"]["init_from"]["step"] == 50
    assert api.post(url, json={"name": "plain", "task": "regression"},
                    headers=users["alice"]).json()["init_from"] is None  # fmt: skip

    def refused(body: dict[str, Any], who: str = "alice") -> dict[str, Any]:
        real = api.post(f"{API}/jobs", json=body, headers=users[who])
        dry = api.post(url, json=body, headers=users[who])
        assert real.status_code == dry.status_code == 422, (real.text, dry.text)
        assert dry.json()["detail"] == real.json()["detail"]
        return dict(dry.json()["detail"][0])

    assert refused(spec(job=job + 1000))["loc"] == ["body", "init_from", "job"]
    assert refused(spec(job=job), "bob")["loc"] == ["body", "init_from", "job"], "not bob's job"
    assert refused(spec(job=job, step=7))["loc"] == ["body", "init_from", "step"]
    assert refused(spec(20, job=job, mode="full"))["loc"] == ["body", "init_from", "step"]
    jobs = api.get(f"{API}/jobs", headers=users["alice"]).json()
    assert all(j["name"] != "ft" for j in jobs.get("jobs", jobs)), "a dry run stores nothing"
