"""Every error answer of the API carries ``code``, the stable name clients branch on: a ddpq
error's class code, ``invalid_request`` for a malformed request, and a code per status for
the router's and the token checks' own errors. SQLite only: the handlers are not SQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.core.config import Settings
from service.core.errors import JobNotFoundError, SweepNotFoundError
from service.core.wire import API_PREFIX
from service.store.db import Database


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ddpq.db'}"


@pytest.fixture
def api(settings: Settings, db: Database) -> Iterator[TestClient]:
    with TestClient(create_app(settings.model_copy(update={"max_body_bytes": 2048}))) as c:
        yield c


def test_not_found_answers_name_the_resource(api: TestClient) -> None:
    job = api.get(f"{API_PREFIX}/jobs/424242")
    assert (job.status_code, job.json()) == (
        404,
        {"detail": "job 424242 not found", "code": JobNotFoundError.code},
    )
    sweep = api.get(f"{API_PREFIX}/sweeps/4242")
    assert sweep.status_code == 404 and sweep.json()["code"] == SweepNotFoundError.code
    cancel = api.post(f"{API_PREFIX}/jobs/424242/cancel")
    assert cancel.status_code == 404 and cancel.json()["code"] == JobNotFoundError.code


def test_bad_input_and_the_routers_own_errors_carry_a_code(api: TestClient) -> None:
    spec = api.post(f"{API_PREFIX}/jobs", json={"name": "x", "task": "no-such-task"})
    assert spec.status_code == 422 and spec.json()["code"] in ("invalid_spec", "invalid_request")
    assert isinstance(spec.json()["detail"], list), "the field list stays in detail"
    query = api.get(f"{API_PREFIX}/jobs", params={"limit": "many"})
    assert query.status_code == 422 and query.json()["code"] == "invalid_request"
    route = api.get(f"{API_PREFIX}/no-such-route")
    assert route.status_code == 404 and route.json() == {"detail": "Not Found", "code": "not_found"}
    method = api.delete(f"{API_PREFIX}/jobs")
    assert method.status_code == 405 and method.json()["code"] == "method_not_allowed"
    assert "GET" in method.headers["allow"]
    big = api.post(f"{API_PREFIX}/jobs", content=b"x" * 4096)
    assert big.status_code == 413 and big.json()["code"] == "body_too_large"


def test_a_refused_token_has_a_code(settings: Settings, db: Database) -> None:
    with TestClient(create_app(settings.model_copy(update={"auth": "on"}))) as api:
        r = api.get(f"{API_PREFIX}/jobs")
    assert r.status_code == 401 and r.json()["code"] == "unauthorized"
    assert r.headers["www-authenticate"].startswith("Bearer")


def test_an_unexpected_exception_is_500_with_a_code_and_no_traceback(
    settings: Settings, db: Database
) -> None:
    """A bug in a route (what a worker's unchecked event data once hit) answers like every
    other error, not Starlette's plain-text "Internal Server Error"."""
    app = create_app(settings)

    def broken() -> None:
        raise TypeError("can't multiply sequence by non-int of type 'str'")

    app.add_api_route(f"{API_PREFIX}/broken-for-test", broken, methods=["GET"])
    with TestClient(app, raise_server_exceptions=False) as api:
        r = api.get(f"{API_PREFIX}/broken-for-test")
    assert r.status_code == 500, r.text
    assert r.json() == {"detail": "internal server error", "code": "internal_error"}
    assert "multiply" not in r.text
