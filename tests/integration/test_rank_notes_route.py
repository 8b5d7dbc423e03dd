"""``POST /attempts/self/notes`` over the real app (SQLite and PostgreSQL): rank 0's decisions
become job events worded by the server, once per attempt; only the current attempt's token may
write one."""

from __future__ import annotations

from fastapi.testclient import TestClient

from service.core.wire import attempt as wire
from service.store.auth.tokens import create_token
from service.store.db import Database
from service.store.jobs.crud import list_events
from tests.uploads import API, bearer, mint, requeue, running_job

URL = API + wire.NOTES_PATH


def reasons(db: Database, job_id: int) -> list[str]:
    with db.session(write=False) as s:
        return [e.reason or "" for e in list_events(s, job_id)]


def test_notes_become_events_once_and_only_for_the_current_attempt(
    db: Database, api: TestClient
) -> None:
    job_id = running_job(db)
    rank = mint(db, job_id, 1)
    note = {"kind": "nothing_to_train", "step": 100, "total_steps": 50}
    for _ in range(2):  # a resend: one event
        assert api.post(URL, json=note, headers=rank).status_code == 204
    assert api.post(URL, json={"kind": "upload_fallback"}, headers=rank).status_code == 204
    found = reasons(db, job_id)
    assert sum(r.startswith("init_from step 100 ≥ this job's 50 steps: nothing to train")
               for r in found) == 1  # fmt: skip
    assert any("uploading instead" in r for r in found)

    bad = [{"kind": "free text"}, {"kind": "upload_fallback", "reason": "x"}, {}]
    for body in bad:
        assert api.post(URL, json=body, headers=rank).status_code == 422, body
    with db.session() as s:
        user = bearer(create_token(s, owner="alice")[1])
    assert api.post(URL, json=note, headers=user).status_code == 401, "a user's token"
    assert api.post(URL, json=note).status_code == 401
    requeue(db, job_id)
    before = reasons(db, job_id)
    r = api.post(URL, json={**note, "step": 101}, headers=rank)  # attempt 1, superseded
    assert r.status_code == 409 and "attempt superseded" in r.text
    assert reasons(db, job_id) == before
