"""What a resume does to checkpoints shows in the job's events (real app, SQLite and
PostgreSQL): each checkpoint rank 0 found damaged and deleted, and an attempt that starts from
step 0 although the job had checkpoints, naming the damaged steps."""

from __future__ import annotations

from fastapi.testclient import TestClient

from service.core import artifacts
from service.core.config import Settings
from service.core.wire import attempt as wire
from service.store.db import Database
from service.store.jobs.crud import list_events
from tests.uploads import API, mint, requeue, running_job, sha


def reasons(db: Database, job_id: int) -> list[str]:
    with db.session(write=False) as s:
        return [e.reason or "" for e in list_events(s, job_id)]


def record(api: TestClient, settings: Settings, rank: dict[str, str], job_id: int,
           step: int) -> None:  # fmt: skip
    path = artifacts.checkpoint_path(settings.resolved_artifact_dir, job_id, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = b"ckpt %d" % step
    path.write_bytes(data)
    body = {"step": step, "epoch": 0, "path": str(path), "size_bytes": len(data),
            "sha256": sha(data)}  # fmt: skip
    assert api.post(API + wire.CHECKPOINTS_PATH, json=body, headers=rank).status_code == 201


def test_a_damaged_checkpoint_and_the_fresh_start_it_causes_are_job_events(
    db: Database, settings: Settings, api: TestClient
) -> None:
    job_id = running_job(db, training={"keep_checkpoints": 1})
    first = mint(db, job_id, 1)
    record(api, settings, first, job_id, 65)
    requeue(db, job_id)
    second = mint(db, job_id, 2)
    other = running_job(db)
    other_rank = mint(db, other, 1)

    # A superseded attempt, and another job's token, delete nothing and note nothing.
    before = reasons(db, job_id)
    deletions = API + wire.CHECKPOINT_DELETIONS_PATH
    assert api.post(deletions, json={"steps": [65]}, headers=first).status_code == 409
    assert api.post(deletions, json={"steps": [65]}, headers=other_rank).status_code == 204
    assert reasons(db, job_id) == before and not any("damaged" in r for r in reasons(db, other))

    assert api.post(deletions, json={"steps": [65, 99]}, headers=second).status_code == 204
    timeline = API + wire.TIMELINE_PATH
    for _ in range(2):  # told twice (a resend): one event
        assert api.post(timeline, json={"resume_step": 0}, headers=second).status_code == 204
    found = reasons(db, job_id)
    assert found.count("checkpoint at step 65 found damaged at resume and deleted") == 1
    assert not any("step 99" in r for r in found), "a step without a checkpoint is no event"
    assert found.count("attempt 2 starts from step 0: no intact checkpoint (step 65 damaged)") == 1
    assert api.get(f"{API}/jobs/{job_id}/checkpoints").json()["checkpoints"] == []


def test_a_first_start_and_a_resume_say_nothing(
    db: Database, settings: Settings, api: TestClient
) -> None:
    job_id = running_job(db)
    rank = mint(db, job_id, 1)
    assert (
        api.post(API + wire.TIMELINE_PATH, json={"resume_step": 0}, headers=rank).status_code == 204
    )
    record(api, settings, rank, job_id, 10)
    requeue(db, job_id)
    second = mint(db, job_id, 2)
    assert (
        api.post(API + wire.TIMELINE_PATH, json={"resume_step": 10}, headers=second).status_code
        == 204
    )
    assert not any("starts from step 0" in r for r in reasons(db, job_id))


def test_a_file_not_put_in_place_is_not_called_damaged(
    db: Database, settings: Settings, api: TestClient
) -> None:
    job_id = running_job(db)
    rank = mint(db, job_id, 1)
    record(api, settings, rank, job_id, 4)
    body = {"steps": [4], "damaged": False}
    assert (
        api.post(API + wire.CHECKPOINT_DELETIONS_PATH, json=body, headers=rank).status_code == 204
    )
    assert "checkpoint at step 4 deleted: its file could not be put in place" in reasons(db, job_id)
