"""API tokens, owners and the auth switch over the real app, on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.cli.main import server_settings
from service.core.config import Settings
from service.core.spec.model import validate_spec
from service.core.wire import API_PREFIX
from service.store.auth.tokens import create_token, list_tokens, revoke_token
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs import crud as jobs
from service.store.workers import registry as workers
from worker.up import settings_env

API = API_PREFIX
SPEC: dict[str, Any] = {
    "name": "reg",
    "task": "regression",
    "resources": {"nproc_per_node": 2},
    "training": {"max_steps": 10},
}
# Answer without a token: liveness. (So do the dashboard's HTML shells, static files and
# the OpenAPI document: they hold no data.)
OPEN_PATHS = {"/healthz", f"{API}/healthz"}
# A path's {digest} (a workspace): the route matches only a sha256.
DIGEST = "0" * 64


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def make_token(db: Database, owner: str, admin: bool = False) -> str:
    with db.session() as s:
        return create_token(s, owner=owner, admin=admin)[1]


def job_count(db: Database) -> int:
    with db.session(write=False) as s:
        return len(jobs.list_jobs(s, limit=10_000)[0])


@pytest.fixture
def auth_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"auth": "on"})


@pytest.fixture
def app_settings(auth_settings: Settings) -> Settings:
    """What this module's ``api`` serves (tests/conftest.py)."""
    return auth_settings


@pytest.fixture
def tokens(db: Database) -> dict[str, str]:
    return {
        "alice": make_token(db, "alice"),
        "bob": make_token(db, "bob"),
        "root": make_token(db, "ops", admin=True),
    }


def submit_as(api: TestClient, token: str, **changes: Any) -> dict[str, Any]:
    r = api.post(f"{API}/jobs", json={**SPEC, **changes}, headers=bearer(token))
    assert r.status_code == 201, r.text
    body: dict[str, Any] = r.json()
    return body


def guarded_requests(app: Any) -> list[tuple[str, str]]:
    """(method, path) of every operation in the OpenAPI document but /healthz, plus the
    dashboard's spec parser; path parameters set to 1."""
    found = [("POST", "/submit/parse-spec")]
    for path, operations in app.openapi()["paths"].items():
        if path in OPEN_PATHS:
            continue
        concrete = (
            path.replace("{job_id}", "1")
            .replace("{step}", "1")
            .replace("{upload_id}", "1")  # a workspace upload's route matches numbers only
            .replace("{digest}", DIGEST)
        )
        found += [(method.upper(), concrete) for method in sorted(operations)]
    return found


def test_every_route_but_healthz_needs_a_token(api: TestClient, db: Database) -> None:
    routes = guarded_requests(api.app)
    assert len(routes) >= 14, f"expected every API route to be listed, got {routes}"
    for method, path in routes:
        for headers, error in (
            ({}, None),
            (bearer("ddpq_not-a-real-token"), 'error="invalid_token"'),
            ({"Authorization": "Basic YWxpY2U6cHc="}, None),
        ):
            r = api.request(method, path, headers=headers, json=SPEC)
            assert r.status_code == 401, f"{method} {path} with {headers}: {r.status_code}"
            challenge = r.headers.get("www-authenticate", "")
            assert challenge.startswith("Bearer"), f"{method} {path}: {challenge!r}"
            assert error is None or error in challenge
    assert job_count(db) == 0, "a refused POST /jobs stores nothing"
    assert api.get("/healthz").json() == {"status": "ok"}
    for shell in ("/", "/jobs/1", "/submit", "/workers"):
        assert api.get(shell).status_code == 200, f"dashboard shell {shell} loads without a token"


def test_owners_see_only_their_jobs_and_admins_see_all(
    api: TestClient, db: Database, tokens: dict[str, str]
) -> None:
    a = submit_as(api, tokens["alice"], name="alice-job")
    b = submit_as(api, tokens["bob"], name="bob-job")
    assert (a["owner"], b["owner"]) == ("alice", "bob"), "a job's owner is its token's owner"

    bob = bearer(tokens["bob"])
    for path in (
        f"/jobs/{a['id']}",
        f"/jobs/{a['id']}/events",
        f"/jobs/{a['id']}/metrics",
        f"/jobs/{a['id']}/metrics/names",
        f"/jobs/{a['id']}/checkpoints",
        f"/jobs/{a['id']}/checkpoints/1/file",
        f"/jobs/{a['id']}/logs",
    ):
        r = api.get(API + path, headers=bob)
        assert r.status_code == 404, f"bob GET {path}: {r.status_code} {r.text}"
    assert api.get(f"{API}/jobs/{a['id'] + 1000}", headers=bob).json() == {
        "detail": f"job {a['id'] + 1000} not found",
        "code": "job_not_found",
    }, "someone else's job and a missing one answer alike"
    assert api.post(f"{API}/jobs/{a['id']}/cancel", headers=bob).status_code == 404
    assert api.get(f"{API}/jobs/{a['id']}", headers=bearer(tokens["alice"])).json()["state"] == (
        "queued"
    ), "bob's cancel changed nothing"

    def listed(token: str) -> list[str]:
        r = api.get(f"{API}/jobs", headers=bearer(token))
        assert r.status_code == 200, r.text
        return [j["name"] for j in r.json()["jobs"]]

    assert listed(tokens["bob"]) == ["bob-job"]
    assert listed(tokens["alice"]) == ["alice-job"]
    assert listed(tokens["root"]) == ["bob-job", "alice-job"]
    root = bearer(tokens["root"])
    assert api.get(f"{API}/jobs/{a['id']}", headers=root).json()["owner"] == "alice"
    r = api.post(f"{API}/jobs/{b['id']}/cancel", headers=root)
    assert r.status_code == 202 and r.json()["state"] == "cancelled", "admins cancel any job"


def test_workers_show_every_worker_but_only_your_own_jobs(
    api: TestClient, db: Database, tokens: dict[str, str]
) -> None:
    a = submit_as(api, tokens["alice"], name="alice-job")
    with db.session() as s:
        workers.register_worker(
            s, worker_id="w1", host="h", pid=1, launcher="local", capacity={"slots": 4}
        )
    with db.session() as s:
        claimed = claims.claim_next_job(
            s, worker_id="w1", launcher="local", max_gpus_per_node=0, lease_s=30
        )
        assert claimed is not None and claimed.id == a["id"]

    def held(token: str) -> dict[str, list[int]]:
        r = api.get(f"{API}/workers", headers=bearer(token))
        assert r.status_code == 200, r.text
        return {w["id"]: w["running_jobs"] for w in r.json()["workers"]}

    assert held(tokens["alice"]) == {"w1": [a["id"]]}
    assert held(tokens["bob"]) == {"w1": []}, "bob sees the worker, not alice's job id"
    assert held(tokens["root"]) == {"w1": [a["id"]]}


def test_a_revoked_token_stops_working_at_once(
    api: TestClient, db: Database, tokens: dict[str, str]
) -> None:
    alice = bearer(tokens["alice"])
    assert api.get(f"{API}/jobs", headers=alice).status_code == 200
    with db.session() as s:
        token_id = next(t.id for t in list_tokens(s) if t.owner == "alice")
        revoke_token(s, token_id)
    r = api.get(f"{API}/jobs", headers=alice)
    assert r.status_code == 401 and 'error="invalid_token"' in r.headers["www-authenticate"]
    assert api.get(f"{API}/jobs", headers=bearer(tokens["bob"])).status_code == 200


def test_auth_off_everyone_is_the_default_owner_and_sees_every_job(
    settings: Settings, db: Database
) -> None:
    with db.session() as s:
        jobs.submit_job(s, validate_spec(SPEC, settings), owner="alice")
    with TestClient(create_app(settings.model_copy(update={"auth": "off"}))) as api:
        r = api.post(f"{API}/jobs", json=SPEC, headers=bearer("anything-at-all"))
        assert r.status_code == 201 and r.json()["owner"] == settings.default_owner
        owners = [j["owner"] for j in api.get(f"{API}/jobs").json()["jobs"]]
        assert owners == [settings.default_owner, "alice"]
        assert api.get("/readyz").status_code == 200


@pytest.mark.parametrize(
    ("host", "auth", "enabled"),
    [
        ("127.0.0.1", "auto", False),
        ("localhost", "auto", False),
        ("::1", "auto", False),
        ("127.0.0.2", "auto", False),
        ("0.0.0.0", "auto", True),
        ("::", "auto", True),
        ("10.1.2.3", "auto", True),
        ("gpu-box.example", "auto", True),
        ("0.0.0.0", "off", False),
        ("127.0.0.1", "on", True),
    ],
)
def test_auth_auto_follows_the_bind_host(host: str, auth: str, enabled: bool) -> None:
    assert Settings(host=host, auth=auth).auth_enabled is enabled


def test_serve_and_up_pass_the_bind_host_to_the_app(
    monkeypatch: pytest.MonkeyPatch, settings: Settings, db: Database
) -> None:
    monkeypatch.delenv("DDPQ_HOST", raising=False)
    monkeypatch.delenv("DDPQ_AUTH", raising=False)
    wide = server_settings("0.0.0.0", None)  # `ddpq serve/up --host 0.0.0.0`
    assert wide.auth_enabled and not server_settings(None, None).auth_enabled
    # `ddpq up` starts the API as a child process that reads its settings from DDPQ_*.
    for key, value in settings_env(wide).items():
        monkeypatch.setenv(key, value)
    assert Settings().auth_enabled, "the API child of `ddpq up --host 0.0.0.0` demands tokens"
    on_all = settings.model_copy(update={"host": "0.0.0.0"})
    with TestClient(create_app(on_all)) as api:
        assert api.get(f"{API}/jobs").status_code == 401


def test_oversized_body_is_413_and_stores_nothing(
    api: TestClient, db: Database, auth_settings: Settings, tokens: dict[str, str]
) -> None:
    big = {**SPEC, "tags": ["x" * 1000] * (auth_settings.max_body_bytes // 1000 + 1)}
    for headers in (bearer(tokens["alice"]), {}):
        r = api.post(f"{API}/jobs", json=big, headers=headers)
        assert r.status_code == 413, r.text
    assert job_count(db) == 0


def test_two_authorization_headers_are_refused(api: TestClient, tokens: dict[str, str]) -> None:
    """Whichever header a proxy in front reads, the app must not pick another: two → 401."""
    mine = submit_as(api, tokens["alice"], name="alice-job")
    for first, second in ((tokens["alice"], tokens["bob"]), (tokens["bob"], tokens["alice"])):
        r = api.get(
            f"{API}/jobs/{mine['id']}",
            headers=[("Authorization", f"Bearer {first}"), ("Authorization", f"Bearer {second}")],
        )
        assert r.status_code == 401, r.text
        assert 'error="invalid_request"' in r.headers["www-authenticate"]
    assert api.get(f"{API}/jobs/{mine['id']}", headers=bearer(tokens["alice"])).status_code == 200
