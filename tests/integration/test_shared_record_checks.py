"""The shared-filesystem record (``POST /attempts/self/checkpoints``) over the real app, on
SQLite and PostgreSQL: the server reads the named file before it writes the row, so a phantom
(no file, another size or sha256) is refused with 422 and a job event and never becomes the
"latest" that retention would keep instead of the real checkpoints."""

from __future__ import annotations

import hashlib
from pathlib import Path

from fastapi.testclient import TestClient

from service.app import create_app
from service.core import artifacts
from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.core.wire import API_PREFIX
from service.core.wire import attempt as wire
from service.store.checkpoints.crud import list_checkpoints
from service.store.db import Database
from service.store.jobs.crud import list_events
from tests.rank_api import mint_token, running_job

URL = API_PREFIX + wire.CHECKPOINTS_PATH


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def write_ckpt(settings: Settings, job_id: int, step: int, data: bytes) -> tuple[Path, dict]:
    path = artifacts.checkpoint_path(settings.resolved_artifact_dir, job_id, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    body = {"step": step, "epoch": 0, "path": str(path), "size_bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip
    return path, body


def events(db: Database, job_id: int) -> list[str]:
    with db.session(write=False) as s:
        return [e.reason or "" for e in list_events(s, job_id)]


def live_steps(db: Database, job_id: int) -> list[int]:
    with db.session(write=False) as s:
        return [c.step for c in list_checkpoints(s, job_id)]


def test_phantoms_are_refused_with_an_event_and_keep_the_real_checkpoint(
    db: Database, settings: Settings, api: TestClient
) -> None:
    spec = JobSpec.model_validate(
        {"name": "t", "task": "regression", "training": {"keep_checkpoints": 1}}
    )
    job_id, attempt = running_job(db, spec)
    token = mint_token(db, job_id, attempt)
    _, real = write_ckpt(settings, job_id, 10, b"real bytes")
    assert api.post(URL, json=real, headers=bearer(token)).status_code == 201

    phantom = {"step": 30000007, "epoch": 0, "path": f"jobs/{job_id}/checkpoints/step-999.pt",
               "size_bytes": 1, "sha256": "0" * 64}  # fmt: skip
    r = api.post(URL, json=phantom, headers=bearer(token))
    assert r.status_code == 422, r.text
    assert "no file step-999.pt" in r.text
    _, wrong_size = write_ckpt(settings, job_id, 20, b"twenty")
    r = api.post(URL, json={**wrong_size, "size_bytes": 7}, headers=bearer(token))
    assert r.status_code == 422 and "holds 6 bytes" in r.text
    r = api.post(URL, json={**wrong_size, "sha256": "1" * 64}, headers=bearer(token))
    assert r.status_code == 422 and "sha256" in r.text
    elsewhere = settings.resolved_artifact_dir / "jobs" / str(job_id) / "step-21.pt"
    elsewhere.write_bytes(b"x")
    outside = {**wrong_size, "path": str(elsewhere), "size_bytes": 1,
               "sha256": hashlib.sha256(b"x").hexdigest()}  # fmt: skip
    r = api.post(URL, json=outside, headers=bearer(token))
    assert r.status_code == 422 and "checkpoint directory" in r.text

    odd = (b'{"step": 22, "epoch": 0, "path": "jobs/%d/checkpoints/step-\\ud800.pt", '
           b'"size_bytes": 1, "sha256": "%s"}') % (job_id, b"0" * 64)  # fmt: skip
    r = api.post(URL, content=odd, headers={**bearer(token), "Content-Type": "application/json"})
    assert r.status_code == 422, r.text  # a lone surrogate in the name: no 500

    assert live_steps(db, job_id) == [10], "no phantom became the latest; retention kept 10"
    reasons = events(db, job_id)
    assert any(r.startswith("checkpoint at step 30000007 not written: ") for r in reasons)
    assert sum(r.startswith("checkpoint at step 20 not written") for r in reasons) == 3


def test_the_staged_file_is_verified_before_the_rename(
    db: Database, settings: Settings, api: TestClient
) -> None:
    """Rank 0 records first and renames after: the server reads the staged temp file."""
    job_id, attempt = running_job(db)
    token = mint_token(db, job_id, attempt)
    final, body = write_ckpt(settings, job_id, 5, b"staged")
    staged = final.with_name(".step-5.pt.tmp-1-2")
    final.rename(staged)
    r = api.post(URL, json={**body, "staged_path": str(staged)}, headers=bearer(token))
    assert r.status_code == 201, r.text
    assert r.json()["path"] == str(final) and "staged_path" not in r.json()
    outside = settings.resolved_artifact_dir / "elsewhere.tmp"
    outside.write_bytes(b"staged")
    r = api.post(URL, json={**body, "step": 6, "staged_path": str(outside)},
                 headers=bearer(token))  # fmt: skip
    assert r.status_code == 422
    assert live_steps(db, job_id) == [5]


def test_who_may_not_record_gets_no_row_and_no_event(
    db: Database, settings: Settings, api: TestClient
) -> None:
    a_id, a_attempt = running_job(db)
    b_id, b_attempt = running_job(db)
    a_token, b_token = mint_token(db, a_id, a_attempt), mint_token(db, b_id, b_attempt)
    _, a_body = write_ckpt(settings, a_id, 3, b"a's file")
    # Another job's token naming a's real file: outside b's directory.
    r = api.post(URL, json=a_body, headers=bearer(b_token))
    assert r.status_code == 422
    assert live_steps(db, a_id) == [] and live_steps(db, b_id) == []
    # No attempt token at all.
    assert api.post(URL, json=a_body).status_code == 401
    # A superseded attempt's token: 409, nothing noted.
    from service.core.states import JobState
    from service.store.jobs.crud import Transition, apply_transition

    with db.session() as s:
        apply_transition(s, Transition(a_id, JobState.RUNNING, JobState.CANCELLED))
    before = events(db, a_id)
    r = api.post(URL, json={**a_body, "size_bytes": 1}, headers=bearer(a_token))
    assert r.status_code == 409 and "attempt superseded" in r.text
    assert events(db, a_id) == before


def test_with_the_database_store_the_record_route_says_upload(
    db: Database, settings: Settings
) -> None:
    db_settings = settings.model_copy(update={"checkpoint_store": "database"})
    job_id, attempt = running_job(db)
    token = mint_token(db, job_id, attempt)
    _, body = write_ckpt(settings, job_id, 4, b"bytes")
    with TestClient(create_app(db_settings)) as api:
        r = api.post(URL, json=body, headers=bearer(token))
    assert r.status_code == 422 and "upload" in r.text
    assert live_steps(db, job_id) == []
    assert any(e.startswith("checkpoint at step 4 not written") for e in events(db, job_id))
