"""The attempt API over the real app, on SQLite and PostgreSQL: a rank's token writes its own
job's current attempt and nothing else, with auth on and off."""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from service.api.attempts.routes import IngestLimiter, ingest_limiter
from service.app import create_app
from service.core.artifacts import checkpoint_path
from service.core.config import Settings
from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.core.wire import attempt as wire
from service.store.attempts.tokens import AttemptRef, find_attempt, mint_attempt_token
from service.store.auth.tokens import hash_token
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs import crud as jobs
from service.store.models import AttemptToken
from service.store.workers import registry as workers
from tests.live import serve_app

API = API_PREFIX
SPEC: dict[str, Any] = {"name": "reg", "task": "regression", "training": {"max_steps": 10}}
SHA = "ab" * 32
ROUTES = [  # every attempt route with a well-formed body
    ("GET", wire.SELF_PATH, None),
    ("POST", wire.METRICS_PATH, {"points": [["loss", 1, 0, 0.5, 1.7e9]]}),
    ("GET", wire.CHECKPOINTS_PATH, None),
    ("POST", wire.CHECKPOINTS_PATH, None),  # body: a path of the job's own (see _body)
    ("POST", wire.CHECKPOINT_FAILURES_PATH, {"step": 3, "reason": "disk full"}),
    ("POST", wire.CHECKPOINT_DELETIONS_PATH, {"steps": [3]}),
    ("POST", wire.TIMELINE_PATH, {"checkpoint_stall_s": 0.5, "checkpoint_saves": 1}),
]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _body(settings: Settings, job_id: int, path: str, body: Any) -> Any:
    if path == wire.CHECKPOINTS_PATH and body is None:
        ckpt = checkpoint_path(settings.resolved_artifact_dir, job_id, 3)
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        ckpt.write_bytes(b"0123456789")  # the server verifies the file it records
        sha = hashlib.sha256(b"0123456789").hexdigest()
        return {"step": 3, "epoch": 0, "path": str(ckpt), "size_bytes": 10, "sha256": sha}
    return body


def call(api: TestClient, settings: Settings, token: str, job_id: int, route: Any) -> Any:
    method, path, body = route
    body = _body(settings, job_id, path, body)
    return api.request(method, API + path, headers=bearer(token), json=body)


def start_jobs(api: TestClient, db: Database, owners: dict[str, dict[str, str]]) -> dict[str, int]:
    """Submit one job per owner (``{owner: headers}``) and claim them all (attempt 1)."""
    ids = {}
    for owner, headers in owners.items():
        r = api.post(f"{API}/jobs", json={**SPEC, "name": owner}, headers=headers)
        assert r.status_code == 201, r.text
        ids[owner] = r.json()["id"]
    with db.session() as s:
        workers.register_worker(
            s, worker_id="w1", host="h", pid=1, launcher="local", capacity={"slots": 4}
        )
    for _ in ids:
        with db.session() as s:
            job = claims.claim_next_job(
                s, worker_id="w1", launcher="local", max_gpus_per_node=0, lease_s=300
            )
            assert job is not None
    return ids


def mint(db: Database, job_id: int, attempt: int = 1) -> str:
    with db.session() as s:
        return mint_attempt_token(s, job_id, attempt)


def move(db: Database, job_id: int, expected: JobState, target: JobState) -> None:
    with db.session() as s:
        jobs.apply_transition(s, jobs.Transition(job_id, expected, target, "test"))


@pytest.fixture
def auth_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"auth": "on"})


@pytest.fixture
def app_settings(auth_settings: Settings) -> Settings:
    """What this module's ``api`` serves (tests/conftest.py)."""
    return auth_settings


def test_tokens_name_one_attempt_each_and_are_stored_hashed(db: Database) -> None:
    with db.session() as s:
        job, _ = jobs.submit_job(s, jobs_spec(), owner="alice")
        job_id = job.id
    first, second, later = mint(db, job_id), mint(db, job_id), mint(db, job_id, 2)
    assert len({first, second, later}) == 3 and first.startswith(wire.ATTEMPT_TOKEN_PREFIX)
    with db.session(write=False) as s:
        assert find_attempt(s, first) == find_attempt(s, second) == AttemptRef(job_id, 1)
        assert find_attempt(s, later) == AttemptRef(job_id, 2)
        for garbage in ("", "ddpqa_", first + "x", first[:-1], "ddpq_" + first[6:], "x" * 10**4):
            assert find_attempt(s, garbage) is None, f"{garbage[:40]!r} must name no attempt"
        stored = {t.token_hash for t in s.query(AttemptToken)}
    assert stored == {hash_token(t) for t in (first, second, later)}, "only hashes are stored"


def jobs_spec() -> Any:
    from service.core.spec.model import JobSpec

    return JobSpec.model_validate(SPEC)


def metrics_bytes(api: TestClient, headers: dict[str, str], job_id: int) -> bytes:
    r = api.get(f"{API}/jobs/{job_id}/metrics", params={"name": "loss"}, headers=headers)
    assert r.status_code == 200, r.text
    return r.content


def test_a_rank_writes_its_own_job_and_opens_no_user_route(
    api: TestClient, db: Database, auth_settings: Settings, users: dict[str, dict[str, str]]
) -> None:
    ids = start_jobs(api, db, users)
    a, b = ids["alice"], ids["bob"]
    bob_token = mint(db, b)
    r = api.post(
        API + wire.METRICS_PATH,
        json={"points": [["loss", 1, 0, 9.0, 1.7e9]]},
        headers=bearer(bob_token),
    )
    assert r.status_code == 200, r.text
    bob_before = metrics_bytes(api, users["bob"], b)
    token = mint(db, a)
    rank = bearer(token)

    me = api.get(API + wire.SELF_PATH, headers=rank).json()
    store_id = (auth_settings.resolved_artifact_dir / wire.STORE_ID_FILE).read_text().strip()
    assert me == {
        "job_id": a,
        "attempt": 1,
        "state": "starting",
        "store_id": store_id,
        "init_from": None,
    }
    batch = {
        "points": [
            ["loss", 1, 0, 1.5, 1.7e9],
            ["loss", 2, 0, None, 1.7e9],  # NaN
            ["loss", 3, 0, "Infinity", 1.7e9],
            ["loss", 4, 0, "-Infinity", 1.7e9],
            ["", 5, 0, 1.0, 1.7e9],  # empty name
            ["loss", 0, 0, 1.0, 1.7e9],  # step 0 (steps are 1-based)
            ["loss", 6, 0, "NaN", 1.7e9],  # not one of the two strings
        ],
        "progress": {"step": 4, "total_steps": 10, "epoch": 0, "bogus": [1], "eta_s": "x"},
    }
    r = api.post(API + wire.METRICS_PATH, json=batch, headers=rank)
    assert r.status_code == 200, r.text
    ack = r.json()
    assert (ack["accepted"], ack["inserted"]) == (4, 4), ack
    assert [m.split(":")[0] for m in ack["refused"]] == ["row 4", "row 5", "row 6"], ack
    resent = api.post(API + wire.METRICS_PATH, json=batch, headers=rank).json()
    assert (resent["accepted"], resent["inserted"]) == (4, 0), "a resent batch inserts 0"
    points = api.get(f"{API}/jobs/{a}/metrics", headers=users["alice"]).json()["points"]
    assert [(p["step"], p["value"]) for p in points] == [
        (1, 1.5),
        (2, None),
        (3, "Infinity"),
        (4, "-Infinity"),
    ], "NaN and ±inf round-trip as JSON-safe values"
    job = api.get(f"{API}/jobs/{a}", headers=users["alice"]).json()
    assert job["progress"]["step"] == 4 and job["progress"]["total_steps"] == 10, job

    for route in ROUTES[2:]:
        r = call(api, auth_settings, token, a, route)
        assert r.status_code in (200, 201, 204), f"{route[:2]}: {r.status_code} {r.text}"
    events = api.get(f"{API}/jobs/{a}/events", headers=users["alice"]).json()["events"]
    assert any("checkpoint at step 3 not written: disk full" in (e["reason"] or "") for e in events)
    assert api.get(API + wire.CHECKPOINTS_PATH, headers=rank).json() == {"checkpoints": []}

    # A checkpoint record naming another job's file, or a file outside the artifacts: 422.
    root = auth_settings.resolved_artifact_dir
    for path in (str(checkpoint_path(root, b, 1)), "/etc/passwd", f"jobs/{a}/../{b}/x", "a\x00b"):
        body = {"step": 7, "epoch": 0, "path": path, "size_bytes": 1, "sha256": SHA}
        r = api.post(API + wire.CHECKPOINTS_PATH, json=body, headers=rank)
        assert r.status_code == 422, f"{path!r}: {r.status_code} {r.text}"
    # There is no route taking a job id: a body that names one is refused by the schema.
    forged = [
        (wire.METRICS_PATH, {"job_id": b, "points": [["loss", 9, 0, 1.0, 1.7e9]]}),
        (wire.CHECKPOINT_DELETIONS_PATH, {"job_id": b, "steps": [1]}),
        (wire.CHECKPOINT_FAILURES_PATH, {"job_id": b, "step": 1, "reason": "x"}),
    ]
    for path, body in forged:
        r = api.post(API + path, json=body, headers=rank)
        assert r.status_code == 422, f"{path} with a job id: {r.status_code} {r.text}"

    for path in ("/jobs", f"/jobs/{b}", f"/jobs/{a}", f"/jobs/{a}/metrics", "/workers", "/readyz"):
        r = api.get(API + path, headers=rank)
        assert r.status_code == 401, f"attempt token on {path}: {r.status_code}"
        assert r.json()["detail"].startswith("attempt tokens are valid only under"), r.text
    assert api.get("/readyz", headers=rank).status_code == 401
    r = api.post(f"{API}/jobs/{b}/cancel", headers=rank)
    assert r.status_code == 401, r.text
    for headers in ({}, bearer("ddpqa_garbage"), users["alice"], {"Authorization": "Basic eA=="}):
        r = api.get(API + wire.SELF_PATH, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer"), r.text
    assert metrics_bytes(api, users["bob"], b) == bob_before, "bob's metrics are unchanged"
    assert api.get(f"{API}/jobs/{b}/checkpoints", headers=users["bob"]).json() == {
        "checkpoints": []
    }


def test_a_superseded_attempt_is_refused_everywhere(
    api: TestClient, db: Database, auth_settings: Settings, users: dict[str, dict[str, str]]
) -> None:
    a = start_jobs(api, db, {"alice": users["alice"]})["alice"]
    old = mint(db, a)
    move(db, a, JobState.STARTING, JobState.QUEUED)  # requeued: attempt 2
    for route in ROUTES:
        r = call(api, auth_settings, old, a, route)
        assert r.status_code == 409, f"{route[:2]} after a requeue: {r.status_code} {r.text}"
        assert r.json()["detail"].startswith(wire.ATTEMPT_SUPERSEDED), r.text
    assert api.get(f"{API}/jobs/{a}/metrics", headers=users["alice"]).json()["points"] == []
    with db.session() as s:
        claims.claim_next_job(s, worker_id="w1", launcher="local", max_gpus_per_node=0, lease_s=300)
    new = mint(db, a, 2)
    assert api.get(API + wire.SELF_PATH, headers=bearer(new)).json()["attempt"] == 2
    assert call(api, auth_settings, old, a, ROUTES[1]).status_code == 409, "attempt 1 stays out"
    move(db, a, JobState.STARTING, JobState.RUNNING)
    move(db, a, JobState.RUNNING, JobState.SUCCEEDED)
    for route in ROUTES:
        r = call(api, auth_settings, new, a, route)
        assert r.status_code == 409, f"{route[:2]} after success: {r.status_code} {r.text}"
        assert r.json()["detail"].startswith(wire.ATTEMPT_SUPERSEDED), r.text


def test_too_many_batches_in_flight_answer_429_with_retry_after(
    auth_settings: Settings, db: Database, users: dict[str, dict[str, str]]
) -> None:
    limiter = IngestLimiter(2)
    assert limiter.try_enter() and limiter.try_enter() and not limiter.try_enter()
    limiter.leave()
    assert limiter.try_enter(), "a slot given back is taken again"

    one = auth_settings.model_copy(update={"attempt_ingest_concurrency": 1})
    with TestClient(create_app(one)) as api:
        a = start_jobs(api, db, {"alice": users["alice"]})["alice"]
        rank = bearer(mint(db, a))
        batch = {"points": [["loss", 1, None, 1.0, time.time()]]}
        held = ingest_limiter(api.app)  # type: ignore[arg-type]
        assert held.try_enter(), "the one slot is free"  # a batch being written
        r = api.post(API + wire.METRICS_PATH, json=batch, headers=rank)
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert api.get(f"{API}/jobs/{a}/metrics", headers=users["alice"]).json()["points"] == []
        held.leave()
        r = api.post(API + wire.METRICS_PATH, json=batch, headers=rank)
        assert r.status_code == 200 and r.json()["inserted"] == 1, r.text
        assert held.busy == 0, "the route gave its slot back"


def test_bad_batches_are_422_never_500(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    a = start_jobs(api, db, {"alice": users["alice"]})["alice"]
    rank = bearer(mint(db, a))
    for body in (
        b"not json",
        b"\xff\xfe",
        b'{"points": [["loss", 1.5, 0, 1.0, 0]]}',
        b'{"points": [["loss", 1, 0, 1.0]]}',
        b'{"points": "x"}',
        b"[]",
    ):
        r = api.post(API + wire.METRICS_PATH, content=body, headers=rank)
        assert r.status_code == 422, f"{body!r}: {r.status_code} {r.text}"
    odd = {
        "points": [["loss", 1, 2**40, 1.0, 0], ["loss", 2, 0, 1.0, 1e300], ["x\x00", 3, 0, 1, 0]]
    }
    r = api.post(API + wire.METRICS_PATH, json=odd, headers=rank)
    assert r.status_code == 200 and r.json()["accepted"] == 0, r.text
    assert len(r.json()["refused"]) == 3
    for path, body in (
        (wire.CHECKPOINT_DELETIONS_PATH, {"steps": [2**63]}),
        (wire.CHECKPOINT_FAILURES_PATH, {"step": -1, "reason": "x"}),
        (wire.CHECKPOINTS_PATH, {"step": 1, "epoch": 0, "path": "p", "size_bytes": 1}),
    ):
        r = api.post(API + path, json=body, headers=rank)
        assert r.status_code == 422, f"{path} {body}: {r.status_code} {r.text}"
    # NUL in free text is stored escaped; a lone surrogate is no JSON string pydantic takes.
    rank = {**rank, "Content-Type": "application/json"}
    for raw, status in (
        (b'{"step": 1, "reason": "a\\u0000b"}', 204),
        (b'{"step": 1, "reason": "a\\ud800"}', 422),
        (b'{"points": [["\\ud800", 1, 0, 1.0, 0]]}', 422),
    ):
        path = wire.METRICS_PATH if b"points" in raw else wire.CHECKPOINT_FAILURES_PATH
        r = api.post(API + path, content=raw, headers=rank)
        assert r.status_code == status, f"{raw!r}: {r.status_code} {r.text}"
    events = api.get(f"{API}/jobs/{a}/events", headers=users["alice"]).json()["events"]
    assert any((e["reason"] or "").endswith("a\\0b") for e in events), events


def test_auth_off_an_attempt_token_still_opens_no_user_route(
    settings: Settings, db: Database
) -> None:
    with TestClient(create_app(settings.model_copy(update={"auth": "off"}))) as api:
        a = start_jobs(api, db, {"local": {}})["local"]
        token = mint(db, a)
        for path in (f"{API}/jobs", f"{API}/jobs/{a}", f"{API}/workers", "/readyz"):
            r = api.get(path, headers=bearer(token))
            assert r.status_code == 401, f"{path}: {r.status_code} {r.text}"
            assert api.get(path).status_code == 200, f"{path} without a token (auth off)"
        r = api.post(f"{API}/jobs", json=SPEC, headers=bearer(token))
        assert r.status_code == 401, "a rank cannot submit jobs on the embedded default either"
        assert api.get(API + wire.SELF_PATH).status_code == 401, "attempt routes need a token"
        r = api.get(API + wire.SELF_PATH, headers=bearer(token))
        assert r.status_code == 200 and r.json()["job_id"] == a, r.text


def test_four_sinks_over_live_http_store_every_point_once(
    auth_settings: Settings, db: Database, users: dict[str, dict[str, str]]
) -> None:
    """Four ranks' sinks at once through a real server with one ingest slot: each backs off on
    429 and sends again, and every (job, name, step) lands exactly once."""
    one = auth_settings.model_copy(update={"attempt_ingest_concurrency": 1})
    app = create_app(one)
    with TestClient(app) as setup:
        ids = start_jobs(setup, db, {"alice": users["alice"], "bob": users["bob"]})
    tokens = [
        mint(db, ids["alice"]),
        mint(db, ids["alice"]),
        mint(db, ids["bob"]),
        mint(db, ids["bob"]),
    ]
    refusals: list[str] = []

    def sink(index: int, token: str) -> None:
        with httpx.Client(base_url=url, headers=bearer(token), timeout=30) as client:
            for batch in range(10):
                first = 1 + (index % 2) * 1000 + batch * 100
                rows = [["loss", s, 0, float(s), time.time()] for s in range(first, first + 100)]
                while True:
                    r = client.post(API + wire.METRICS_PATH, json={"points": rows})
                    if r.status_code != 429:
                        break
                    refusals.append(r.headers["retry-after"])
                    time.sleep(0.01)
                assert r.status_code == 200 and r.json()["inserted"] == 100, r.text

    with serve_app(app) as url:
        threads = [threading.Thread(target=sink, args=(i, t)) for i, t in enumerate(tokens)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        with httpx.Client(base_url=url, timeout=30) as client:
            for owner, job_id in ids.items():
                r = client.get(
                    f"{API}/jobs/{job_id}/metrics", params={"limit": 5000}, headers=users[owner]
                )
                steps = [p["step"] for p in r.json()["points"]]
                assert steps == list(range(1, 1001)) + list(range(1001, 2001)), owner
    assert set(refusals) <= {"1"}, refusals
