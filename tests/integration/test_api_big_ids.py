"""Job ids beyond 32 bits through the REST API on SQLite and PostgreSQL: 404s and empty pages,
never "integer out of range" (jobs.id and every job_id are BIGINT)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from service.core.events import EventKind
from service.core.wire import API_PREFIX
from service.store.db import Database
from service.store.events import record_event
from service.store.models import Job

API = API_PREFIX
BIG_IDS = [2**31, 3_000_000_000, 2**53 + 1, 2**63 - 1]


@pytest.mark.parametrize("job_id", BIG_IDS)
def test_big_ids_are_not_found(api: TestClient, job_id: int) -> None:
    for method, path in [
        ("GET", f"/jobs/{job_id}"),
        ("GET", f"/jobs/{job_id}/events"),
        ("POST", f"/jobs/{job_id}/cancel"),
    ]:
        r = api.request(method, f"{API}{path}")
        assert r.status_code == 404, (
            f"{method} {path}: expected 404 for a job id that does not exist, got "
            f"{r.status_code} {r.text} (job ids must be BIGINT in the schema)"
        )


@pytest.mark.parametrize("cursor", ["2147483648", "3000000000", "999999999999999999"])
def test_big_cursor_gives_an_empty_page(api: TestClient, cursor: str) -> None:
    r = api.get(f"{API}/jobs", params={"cursor": cursor})
    assert r.status_code == 200, f"cursor {cursor}: {r.status_code} {r.text}"
    assert r.json() == {"jobs": [], "next_cursor": None}


def test_big_job_ids_are_stored(api: TestClient, db: Database) -> None:
    """A job (with its events) can live at an id beyond 2**31 and is listed from a cursor."""
    r = api.post(f"{API}/jobs", json={"name": "small", "task": "regression"})
    assert r.status_code == 201, r.text
    small = r.json()["id"]
    big = 3_000_000_000
    with db.session() as s:  # a copy of it at a 64-bit id, with its first event
        job = s.get(Job, small)
        assert job is not None
        copy = {c.key: getattr(job, c.key) for c in Job.__table__.columns if c.key != "id"}
        s.add(Job(id=big, **copy))
        s.flush()
        record_event(s, big, 1, EventKind.SUBMITTED, from_state=None, to_state="queued")
    r = api.get(f"{API}/jobs/{big}")
    assert r.status_code == 200 and r.json()["id"] == big, r.text
    r = api.get(f"{API}/jobs/{big}/events")
    assert r.status_code == 200 and len(r.json()["events"]) == 1, r.text
    r = api.get(f"{API}/jobs", params={"cursor": str(big + 1), "limit": 1})
    assert r.status_code == 200, r.text
    assert [j["id"] for j in r.json()["jobs"]] == [big] and r.json()["next_cursor"] == str(big)
    r = api.get(f"{API}/jobs", params={"cursor": str(big)})
    assert [j["id"] for j in r.json()["jobs"]] == [small], r.text
    r = api.post(f"{API}/jobs/{big}/cancel")
    assert r.status_code == 202 and r.json()["state"] == "cancelled", r.text
