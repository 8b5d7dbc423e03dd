"""REST API over real SQLite and PostgreSQL: submit, list, get, cancel, events, workers, errors."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text, update

from service.app import create_app
from service.core.config import Settings
from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs import crud as jobs
from service.store.models import Worker, utcnow
from service.store.workers import registry as workers

API = API_PREFIX
SPEC: dict[str, Any] = {
    "name": "reg",
    "task": "regression",
    "resources": {"nproc_per_node": 2},
    "training": {"max_steps": 10},
}


def job_count(db: Database) -> int:
    with db.session(write=False) as s:
        return len(jobs.list_jobs(s, limit=10_000)[0])


def submit(api: TestClient, **changes: Any) -> dict[str, Any]:
    r = api.post(f"{API}/jobs", json={**SPEC, **changes})
    assert r.status_code == 201, r.text
    body: dict[str, Any] = r.json()
    return body


def claim(db: Database, worker_id: str = "w1") -> int:
    with db.session() as s:
        workers.register_worker(
            s, worker_id=worker_id, host="h", pid=1, launcher="local", capacity={"slots": 4}
        )
    with db.session() as s:
        job = claims.claim_next_job(
            s, worker_id=worker_id, launcher="local", max_gpus_per_node=0, lease_s=30
        )
        assert job is not None, "a queued job should have been claimable"
        return job.id


def test_submit_get_and_job_shape(api: TestClient) -> None:
    r = api.post(f"{API}/jobs", json=SPEC)
    assert r.status_code == 201, r.text
    job = r.json()
    assert r.headers["location"] == f"{API}/jobs/{job['id']}"
    assert isinstance(job["id"], int)
    assert job["state"] == "queued" and job["attempt"] == 1 and job["owner"] == "local"
    assert job["spec"]["resources"]["nproc_per_node"] == 2
    assert job["spec"]["config"]["hidden"] == 32, "task config defaults are filled in"
    assert job["progress"] is None and job["latest_metrics"] == {}
    assert job["created_at"].endswith("Z") or job["created_at"].endswith("+00:00")
    assert job["queue_reason"] is None, "computed by GET /jobs/{id} only"
    got = api.get(f"{API}/jobs/{job['id']}")
    assert got.status_code == 200
    assert job["warnings"] == [
        "no worker of launcher local is registered: the job waits until one starts "
        "(`ddpq worker --launcher local`)"
    ], "a spec no worker could run is queued with a warning"
    body = got.json()
    assert body["queue"]["position"] == 1 and body["queue"]["workers"] == []
    assert job["queue"] is None, "computed by GET /jobs/{id} only"
    del job["warnings"], job["queue"], body["queue"]
    assert body == {**job, "queue_reason": "no live worker for launcher local "
                    "(start one: `ddpq worker --launcher local`)"}  # fmt: skip
    assert api.get(f"{API}/jobs/999999").status_code == 404
    assert api.get(f"{API}/jobs/{2**70}").status_code == 422


def test_list_pages_without_gaps_or_repeats(api: TestClient) -> None:
    ids = [submit(api, name=f"j{i}")["id"] for i in range(25)]
    seen: list[int] = []
    cursor: str | None = None
    pages = 0
    while True:
        params: dict[str, Any] = {"limit": 10}
        if cursor:
            params["cursor"] = cursor
        page = api.get(f"{API}/jobs", params=params).json()
        seen += [j["id"] for j in page["jobs"]]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == sorted(ids, reverse=True), "newest first, every job exactly once"
    assert pages == 3


def test_list_filters_caps_and_rejects(api: TestClient, settings: Settings, db: Database) -> None:
    a, b = submit(api)["id"], submit(api)["id"]
    api.post(f"{API}/jobs/{a}/cancel")
    cancelled = api.get(f"{API}/jobs", params={"state": "cancelled"}).json()["jobs"]
    assert [j["id"] for j in cancelled] == [a]
    queued = api.get(f"{API}/jobs", params={"state": "queued"}).json()["jobs"]
    assert [j["id"] for j in queued] == [b]
    for params in ({"state": "bogus"}, {"limit": 0}, {"limit": "x"}, {"cursor": "abc"}):
        r = api.get(f"{API}/jobs", params=params)
        assert r.status_code == 422, (params, r.text)
        assert r.json()["detail"][0]["loc"][0] == "query"
    assert "succeeded" in api.get(f"{API}/jobs", params={"state": "bogus"}).text
    big = api.get(f"{API}/jobs", params={"limit": 10**9})
    assert big.status_code == 200 and len(big.json()["jobs"]) == 2
    settings_small = settings.model_copy(update={"max_list_limit": 1})
    with TestClient(create_app(settings_small)) as small:
        page = small.get(f"{API}/jobs", params={"limit": 50}).json()
        assert len(page["jobs"]) == 1 and page["next_cursor"] is not None


def test_etag_answers_304_until_the_job_changes(api: TestClient, db: Database) -> None:
    job_id = submit(api)["id"]
    first = api.get(f"{API}/jobs/{job_id}")
    etag = first.headers["etag"]
    assert etag.startswith('W/"')
    again = api.get(f"{API}/jobs/{job_id}", headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.content == b""
    listing = api.get(f"{API}/jobs")
    assert (
        api.get(f"{API}/jobs", headers={"If-None-Match": listing.headers["etag"]}).status_code
        == 304
    )
    claim(db)
    changed = api.get(f"{API}/jobs/{job_id}", headers={"If-None-Match": etag})
    assert changed.status_code == 200 and changed.json()["state"] == "starting"
    assert changed.headers["etag"] != etag
    assert (
        api.get(f"{API}/jobs", headers={"If-None-Match": listing.headers["etag"]}).status_code
        == 200
    )


def test_idempotency_key_gives_one_job(api: TestClient, db: Database) -> None:
    headers = {"Idempotency-Key": "retry-1"}
    first = api.post(f"{API}/jobs", json=SPEC, headers=headers)
    second = api.post(f"{API}/jobs", json=SPEC, headers=headers)
    assert (first.status_code, second.status_code) == (201, 200)
    assert first.json()["id"] == second.json()["id"]
    assert job_count(db) == 1
    other = api.post(f"{API}/jobs", json=SPEC, headers={"Idempotency-Key": "retry-2"})
    assert other.status_code == 201 and job_count(db) == 2


BAD_SPECS: list[tuple[str, dict[str, Any], list[str]]] = [
    ("nproc0", {**SPEC, "resources": {"nproc_per_node": 0}}, ["resources", "nproc_per_node"]),
    ("unknown task", {**SPEC, "task": "nosuchtask"}, ["task"]),
    ("unknown launcher", {**SPEC, "launcher": "k8s"}, ["launcher"]),
    ("unknown field", {**SPEC, "colour": "red"}, ["colour"]),
    ("empty name", {**SPEC, "name": ""}, ["name"]),
    ("nccl without gpus", {**SPEC, "backend": "nccl"}, ["backend"]),
    ("bad task config", {**SPEC, "config": {"hidden": -1}}, ["config", "hidden"]),
    ("slurm disabled", {**SPEC, "launcher": "slurm"}, ["launcher"]),
    ("entrypoint not allowed", {**SPEC, "task": "evil.mod:run"}, ["task"]),
    ("nul in name", {**SPEC, "name": "a\x00b"}, ["name"]),
]


@pytest.mark.parametrize(("case", "spec", "field"), BAD_SPECS, ids=[c[0] for c in BAD_SPECS])
def test_bad_spec_is_422_naming_the_field(
    api: TestClient, db: Database, case: str, spec: dict[str, Any], field: list[str]
) -> None:
    r = api.post(f"{API}/jobs", json=spec)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert isinstance(detail, list) and detail
    locs = [e["loc"] for e in detail]
    assert ["body", *field] in locs, f"{case}: expected an error at body.{'.'.join(field)}: {locs}"
    assert all(set(e) == {"loc", "msg", "type"} for e in detail)
    assert job_count(db) == 0, "a rejected spec stores nothing"


def test_every_bad_field_reported_at_once(api: TestClient) -> None:
    spec = {**SPEC, "task": "nosuchtask", "backend": "nccl", "resources": {"nnodes": 2}}
    r = api.post(f"{API}/jobs", json=spec)
    locs = {tuple(e["loc"]) for e in r.json()["detail"]}
    assert {("body", "task"), ("body", "backend"), ("body", "resources", "nnodes")} <= locs


@pytest.mark.parametrize(
    "body",
    [b"", b"{", b"\xff\xfe\x00garbage", b"[1, 2]", b'"a string"', b"[" * 100_000, b"null"],
    ids=["empty", "truncated", "not utf8", "list", "string", "deep", "null"],
)
def test_unparsable_body_is_422_not_500(api: TestClient, db: Database, body: bytes) -> None:
    r = api.post(f"{API}/jobs", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    json.dumps(r.json())
    assert job_count(db) == 0


def test_body_over_the_limit_is_413_and_stores_nothing(api: TestClient, db: Database) -> None:
    huge = {**SPEC, "tags": ["x" * 1000] * 2000}  # ~2 MB
    r = api.post(f"{API}/jobs", json=huge)
    assert r.status_code == 413 and "bytes" in r.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the streamed size is what counts
        yield b'{"name": "x", "task": "regression", "tags": ["'
        for _ in range(2000):
            yield b"y" * 1000
        yield b'"]}'

    streamed = api.post(f"{API}/jobs", content=chunks())
    assert streamed.status_code == 413
    assert job_count(db) == 0


def test_cancel_queued_claimed_and_finished(api: TestClient, db: Database) -> None:
    queued = submit(api)["id"]
    r = api.post(f"{API}/jobs/{queued}/cancel")
    assert r.status_code == 202 and r.json()["state"] == "cancelled"
    claimed = submit(api)["id"]
    claim(db)
    r = api.post(f"{API}/jobs/{claimed}/cancel")
    assert r.status_code == 202
    assert r.json()["state"] == "starting" and r.json()["cancel_requested"] is True
    assert api.post(f"{API}/jobs/{claimed}/cancel").status_code == 202, "idempotent"
    r = api.post(f"{API}/jobs/{queued}/cancel")
    assert r.status_code == 409 and "cancelled" in r.json()["detail"]
    assert api.post(f"{API}/jobs/424242/cancel").status_code == 404


def test_events_are_the_state_history(api: TestClient, db: Database) -> None:
    job_id = submit(api)["id"]
    claim(db)
    with db.session() as s:
        jobs.apply_transition(
            s, jobs.Transition(job_id, JobState.STARTING, JobState.RUNNING, "launched")
        )
    events = api.get(f"{API}/jobs/{job_id}/events").json()["events"]
    assert [(e["from_state"], e["to_state"]) for e in events] == [
        (None, "queued"),
        ("queued", "starting"),
        ("starting", "running"),
    ]
    assert events[1]["worker_id"] == "w1" and events[2]["reason"] == "launched"
    assert set(events[0]) == {
        "id", "attempt", "from_state", "to_state", "kind", "data", "reason", "worker_id",
        "created_at",
    }  # fmt: skip
    assert [e["kind"] for e in events] == ["submitted", "claimed", "state_changed"]
    assert api.get(f"{API}/jobs/5555/events").status_code == 404


def test_typo_hint_and_caps_in_the_same_422(api: TestClient, db: Database) -> None:
    spec = {**SPEC, "strategy": "fsdp", "resources": {"nproc_per_nod": 2, "nnodes": 100}}
    r = api.post(f"{API}/jobs", json=spec)
    assert r.status_code == 422
    by_loc = {tuple(e["loc"]): e["msg"] for e in r.json()["detail"]}
    assert set(by_loc) == {
        ("body", "strategy"),
        ("body", "resources", "nproc_per_nod"),
        ("body", "resources", "nnodes"),
    }, by_loc
    assert by_loc[("body", "resources", "nproc_per_nod")].endswith("did you mean 'nproc_per_node'?")
    assert "cap of 64" in by_loc[("body", "resources", "nnodes")]
    assert job_count(db) == 0


def _reason(api: TestClient, job_id: int) -> str | None:
    r = api.get(f"{API}/jobs/{job_id}")
    assert r.status_code == 200, r.text
    reason: str | None = r.json()["queue_reason"]
    return reason


def _worker(db: Database, worker_id: str, **capacity: Any) -> None:
    with db.session() as s:
        workers.register_worker(
            s, worker_id=worker_id, host="h", pid=1, launcher="local", capacity=capacity
        )


def test_queue_reason_says_why_a_job_waits(
    api: TestClient, db: Database, settings: Settings
) -> None:
    gpu_job = submit(api, name="gpu", resources={"nproc_per_node": 1, "gpus_per_node": 1})["id"]
    assert str(_reason(api, gpu_job)).startswith("no live worker for launcher local")
    _worker(db, "stopped", slots=4, gpus=[0, 1])
    _worker(db, "silent", slots=4, gpus=[0, 1])
    with db.session() as s:
        workers.stop_worker(s, "stopped")
        too_old = utcnow() - timedelta(seconds=3 * settings.heartbeat_interval_s + 1)
        s.execute(update(Worker).where(Worker.id == "silent").values(heartbeat_at=too_old))
    assert str(_reason(api, gpu_job)).startswith("no live worker"), "stopped or silent"
    _worker(db, "cpu-only", slots=1, gpus=[])
    assert _reason(api, gpu_job) == (
        "waiting for a worker with 1 free GPU (live workers have at most 0)"
    )
    cpu_job = submit(api, name="cpu")["id"]
    assert _reason(api, cpu_job) == "waiting for a worker to claim it"
    later = submit(api, name="later")["id"]
    assert _reason(api, later) == "waiting for a worker to claim it (1 queued job ahead)"
    with db.session() as s:
        claimed = claims.claim_next_job(
            s, worker_id="cpu-only", launcher="local", max_gpus_per_node=0, lease_s=30
        )
        assert claimed is not None and claimed.id == cpu_job
    assert _reason(api, later) == "waiting for a free slot (1 live worker, all busy)"
    assert _reason(api, cpu_job) is None, "only queued jobs have a reason"
    _worker(db, "gpu-box", slots=2, gpus=[0])
    with db.session() as s:
        claimed = claims.claim_next_job(
            s, worker_id="gpu-box", launcher="local", max_gpus_per_node=1, lease_s=30
        )
        assert claimed is not None and claimed.id == gpu_job
    second_gpu = submit(api, name="gpu2", resources={"nproc_per_node": 1, "gpus_per_node": 1})
    assert _reason(api, second_gpu["id"]) == (
        "waiting for 1 free GPU on one worker (live workers have at most 0 free now)"
    )
    listed = api.get(f"{API}/jobs").json()["jobs"]
    assert [j["queue_reason"] for j in listed] == [None] * 4, "the list stays cheap"


def test_workers_list_heartbeats_and_held_jobs(api: TestClient, db: Database) -> None:
    job_id = submit(api)["id"]
    claim(db, "w1")
    with db.session() as s:
        workers.register_worker(
            s, worker_id="w2", host="h2", pid=2, launcher="slurm", capacity={"slots": 1}
        )
    listed = {w["id"]: w for w in api.get(f"{API}/workers").json()["workers"]}
    assert set(listed) == {"w1", "w2"}
    assert listed["w1"]["running_jobs"] == [job_id] and listed["w2"]["running_jobs"] == []
    assert 0 <= listed["w1"]["heartbeat_age_s"] < 60
    assert listed["w2"]["capacity"] == {"slots": 1} and listed["w2"]["launcher"] == "slurm"


def test_openapi_and_docs(api: TestClient) -> None:
    schema = api.get("/openapi.json").json()
    paths = schema["paths"]
    for path in (
        API_PREFIX + "/jobs",
        API_PREFIX + "/jobs/{job_id}",
        API_PREFIX + "/jobs/{job_id}/cancel",
        API_PREFIX + "/jobs/{job_id}/events",
        API_PREFIX + "/jobs/{job_id}/metrics",
        API_PREFIX + "/jobs/{job_id}/metrics/names",
        API_PREFIX + "/jobs/{job_id}/checkpoints",
        API_PREFIX + "/jobs/{job_id}/checkpoints/{step}/file",
        API_PREFIX + "/jobs/{job_id}/logs",
        API_PREFIX + "/workers",
        "/healthz",
        "/readyz",
    ):
        assert path in paths, f"{path} missing from OpenAPI"
    body = paths[API_PREFIX + "/jobs"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"] == "#/components/schemas/JobSpec"
    assert "Resources" in schema["components"]["schemas"]
    docs = api.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


# Raw bodies: JSON escapes for lone surrogates, and the NaN/Infinity tokens Python's json reads.
ENTRY = '{"name": "e", "task": "examples.custom_loop:train", '
REG = '{"name": "s", "task": "regression", '
RAW_BAD_BODIES: list[tuple[str, str, list[Any]]] = [
    ("surrogate tag", REG + '"tags": ["\\ud800"]}', ["tags", 0]),
    ("surrogate name", '{"name": "a\\udfffb", "task": "regression"}', ["name"]),
    ("surrogate config", ENTRY + '"config": {"a": {"b": "x\\ud83d"}}}', ["config", "a", "b"]),
    ("surrogate key", ENTRY + '"config": {"k\\ud800": 1}}', ["config", "k\\ud800"]),
    ("NUL key", ENTRY + '"config": {"k\\u0000": 1}}', ["config", "k\\x00"]),
    ("surrogate slurm extra",
     ENTRY + '"launcher": "slurm", "slurm": {"extra": {"gres": "\\udc00"}}}',
     ["slurm", "extra", "gres"]),
    ("Infinity", REG + '"resources": {"mem_gb": Infinity}}', ["resources", "mem_gb"]),
    ("NaN", REG + '"resources": {"mem_gb": NaN}}', ["resources", "mem_gb"]),
    ("1e400", REG + '"resources": {"mem_gb": 1e400}}', ["resources", "mem_gb"]),
    ("NaN in config", ENTRY + '"config": {"lr": NaN}}', ["config", "lr"]),
    ("-Infinity in config", ENTRY + '"config": {"x": [-Infinity]}}', ["config", "x", 0]),
    ("huge cpus_per_task", REG + '"resources": {"cpus_per_task": ' + "1" + "0" * 40 + "}}",
     ["resources", "cpus_per_task"]),
    ("huge mem_gb", REG + '"resources": {"mem_gb": 1e300}}', ["resources", "mem_gb"]),
    ("deep config", ENTRY + '"config": {"d": ' + "[" * 60 + "]" * 60 + "}}",
     ["config", "d", *[0] * 48]),  # spec, config, d: levels 1-3 of at most 50
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "body", "field"), RAW_BAD_BODIES, ids=[c[0] for c in RAW_BAD_BODIES]
)
def test_values_json_cannot_carry_are_422_and_the_list_stays_up(
    settings: Settings, db: Database, case: str, body: str, field: list[Any]
) -> None:
    with TestClient(create_app(settings.model_copy(update={"slurm_enabled": True}))) as api:
        r = api.post(f"{API}/jobs", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 422, f"{case}: {r.status_code} {r.text}"
        locs = [e["loc"] for e in r.json()["detail"]]
        assert ["body", *field] in locs, f"{case}: expected an error at {field}: {locs}"
        assert job_count(db) == 0, "a rejected spec stores nothing"
        listing = api.get(f"{API}/jobs")
        assert listing.status_code == 200 and listing.json()["jobs"] == []


def test_one_bad_stored_row_does_not_break_the_list(api: TestClient, db: Database) -> None:
    if db.dialect != "sqlite":
        pytest.skip("PostgreSQL's jsonb refuses lone surrogates: no such row can exist there")
    good, bad = submit(api)["id"], submit(api, name="old")["id"]
    # A row stored before validation refused lone surrogates (SQLite keeps the JSON escape).
    bad_spec = json.dumps({**SPEC, "name": "old", "tags": ["\ud800"], "config": {"\udfff": 1}})
    with db.engine.begin() as conn:
        conn.execute(
            text("UPDATE jobs SET spec = :spec WHERE id = :id"), {"spec": bad_spec, "id": bad}
        )
    listing = api.get(f"{API}/jobs")
    assert listing.status_code == 200, listing.text
    by_id = {j["id"]: j for j in listing.json()["jobs"]}
    assert set(by_id) == {good, bad}
    assert by_id[bad]["spec"]["tags"] == ["\\ud800"], "served escaped"
    assert by_id[bad]["spec"]["config"] == {"\\udfff": 1}
    assert by_id[good]["spec"]["tags"] == []
    assert api.get(f"{API}/jobs/{bad}").status_code == 200
    cancelled = api.post(f"{API}/jobs/{bad}/cancel")
    assert cancelled.status_code == 202 and cancelled.json()["state"] == "cancelled"


def test_database_errors_answer_503_without_the_database_text(
    api: TestClient, db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    with db.engine.begin() as conn:
        conn.execute(text("ALTER TABLE workers RENAME TO workers_gone"))
    with caplog.at_level(logging.WARNING):
        r = api.get(f"{API}/workers")
    assert r.status_code == 503, r.text
    assert r.json()["detail"] in {"database error", "database unavailable: try again later"}
    for leak in ("workers", "no such table", "does not exist", "SELECT"):
        assert leak not in r.text, f"the client was told the database's text: {r.text}"
    assert "workers" in caplog.text, "the database's text is in the server's log instead"


def test_idempotency_key_with_another_spec_is_422(api: TestClient, db: Database) -> None:
    headers = {"Idempotency-Key": "k-1"}
    first = api.post(f"{API}/jobs", json=SPEC, headers=headers)
    assert first.status_code == 201
    reordered = dict(reversed(list(SPEC.items())))  # the same spec, keys in another order
    again = api.post(f"{API}/jobs", json=reordered, headers=headers)
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    other = api.post(f"{API}/jobs", json={**SPEC, "name": "other"}, headers=headers)
    assert other.status_code == 422, other.text
    [error] = other.json()["detail"]
    assert error["loc"] == ["header", "Idempotency-Key"]
    assert "'k-1' was used for a different spec" in error["msg"]
    assert f"job {first.json()['id']}" in error["msg"]
    assert job_count(db) == 1, "nothing new is stored"
    defaults_spelled_out = {**SPEC, "launcher": "local", "priority": 0}
    same = api.post(f"{API}/jobs", json=defaults_spelled_out, headers=headers)
    assert same.status_code == 200, "the validated spec is compared, not the bytes"
