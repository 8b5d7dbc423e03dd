"""GET /api/v1/jobs?q=…&tag=… over real SQLite and PostgreSQL: a name substring or an exact
tag, validated, paged by the same cursor, the main metric in each row, and with auth on an
owner's filter never reaching another owner's jobs."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.core.config import Settings
from service.core.wire import API_PREFIX
from service.store.auth.tokens import create_token
from service.store.db import Database
from service.store.jobs import claims
from service.store.metrics.points import MetricPoint, record_metrics
from service.store.workers import registry as workers

API = API_PREFIX


def spec(name: str, *tags: str, task: str = "regression") -> dict[str, Any]:
    return {"name": name, "task": task, "tags": list(tags), "training": {"max_steps": 10}}


def submit(api: TestClient, body: dict[str, Any], **headers: str) -> int:
    r = api.post(f"{API}/jobs", json=body, headers=headers)
    assert r.status_code == 201, r.text
    job_id: int = r.json()["id"]
    return job_id


def names(api: TestClient, **params: Any) -> list[str]:
    r = api.get(f"{API}/jobs", params=params)
    assert r.status_code == 200, r.text
    return [j["name"] for j in r.json()["jobs"]]


def test_q_matches_a_name_substring_or_an_exact_tag(api: TestClient) -> None:
    submit(api, spec("ResNet-baseline", "vision"))
    submit(api, spec("charlm-small", "nlp", "nightly"))
    submit(api, spec("digits_100%", "nightly-2"))
    submit(api, spec("other", "Vision"))
    assert names(api, q="resnet") == ["ResNet-baseline"], "case-insensitive name match"
    assert names(api, q="nightly") == ["charlm-small"], "a tag matches exactly, not by prefix"
    assert names(api, q="vision") == ["ResNet-baseline"], "tags are case-sensitive"
    assert names(api, q="%") == ["digits_100%"], "LIKE wildcards match themselves"
    assert names(api, q="_") == ["digits_100%"]
    assert names(api, tag="nightly-2") == ["digits_100%"]
    assert names(api, tag="nightly") == ["charlm-small"]
    assert names(api, tag="small") == [], "tag= does not match names"
    assert names(api, q="a", tag="nlp") == ["charlm-small"], "filters are ANDed"
    assert names(api, q="a", state="queued", tag="nlp") == ["charlm-small"]
    assert names(api, q="a", state="running") == []
    assert names(api, q="zzz") == []


def test_the_cursor_pages_through_the_filtered_jobs_only(api: TestClient) -> None:
    wanted = []
    for i in range(7):
        wanted.append(submit(api, spec(f"sweep-{i}", "sweep")))
        submit(api, spec(f"noise-{i}"))
    seen: list[int] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"q": "sweep", "limit": 3}
        if cursor:
            params["cursor"] = cursor
        body = api.get(f"{API}/jobs", params=params).json()
        seen += [j["id"] for j in body["jobs"]]
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert seen == wanted[::-1], "every match once, newest first, nothing else"


@pytest.mark.parametrize(
    "params",
    [
        {"q": ""},
        {"q": "   "},
        {"q": "a\x00b"},
        {"q": "a\nb"},
        {"q": "x" * 201},
        {"tag": ""},
        {"tag": "t" * 101},
    ],
)
def test_bad_filters_are_422(api: TestClient, params: dict[str, str]) -> None:
    r = api.get(f"{API}/jobs", params=params)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"][:2] == ["query", next(iter(params))]


def test_each_row_carries_its_tasks_main_metric(api: TestClient, db: Database) -> None:
    digits = submit(api, spec("d", task="digits"))
    regression = submit(api, spec("r"))
    with db.session() as s:
        workers.register_worker(
            s, worker_id="w1", host="h", pid=1, launcher="local", capacity={"slots": 4}
        )
    for _ in (digits, regression):  # claimed in submission order
        with db.session() as s:
            job = claims.claim_next_job(
                s, worker_id="w1", launcher="local", max_gpus_per_node=0, lease_s=30
            )
            assert job is not None
            points = [MetricPoint(name="loss", step=1, value=0.25)]
            if job.id == digits:
                points.append(MetricPoint(name="eval_accuracy", step=1, value=0.875))
            record_metrics(s, job.id, 1, points)
    rows = {j["id"]: j for j in api.get(f"{API}/jobs").json()["jobs"]}
    assert (rows[digits]["main_metric"], rows[digits]["main_metric_value"]) == (
        "eval_accuracy",
        0.875,
    )
    assert (rows[regression]["main_metric"], rows[regression]["main_metric_value"]) == (
        "loss",
        0.25,
    )
    queued = submit(api, spec("q", task="charlm"))
    row = api.get(f"{API}/jobs/{queued}").json()
    assert (row["main_metric"], row["main_metric_value"]) == ("loss", None)


def test_an_owners_filter_never_matches_another_owners_jobs(
    settings: Settings, db: Database
) -> None:
    with db.session() as s:
        alice = create_token(s, owner="alice")[1]
        bob = create_token(s, owner="bob")[1]
    on = settings.model_copy(update={"auth": "on"})
    with TestClient(create_app(on)) as api:
        as_alice = {"Authorization": f"Bearer {alice}"}
        as_bob = {"Authorization": f"Bearer {bob}"}
        submit(api, spec("secret-alice", "shared"), **as_alice)
        mine = submit(api, spec("bob-run", "shared"), **as_bob)
        for params in ({"q": "secret"}, {"q": "shared"}, {"tag": "shared"}, {"q": "alice"}):
            r = api.get(f"{API}/jobs", params=params, headers=as_bob)
            assert r.status_code == 200, r.text
            ids = [j["id"] for j in r.json()["jobs"]]
            assert ids == ([mine] if "shared" in params.values() else []), (params, ids)
        r = api.get(f"{API}/jobs", params={"q": "secret"})
        assert r.status_code == 401, "no token, no list"
