"""The attempt, metric and checkpoint use cases called as the API calls them, without HTTP, on
SQLite and PostgreSQL with the real stores: a shared-filesystem record and an upload's commit
go through the one record → retention → delete sequence, and the store itself deletes the
files retention let go; every use case of the attempt API refuses a superseded attempt with
``attempt superseded`` and writes nothing; they hand out frozen values, never ORM rows."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import func, select

from service.core.artifacts import checkpoint_dir
from service.core.config import Settings
from service.core.errors import StaleAttemptError
from service.core.metrics.points import MetricPoint, checked_point
from service.core.wire.attempt import ATTEMPT_SUPERSEDED
from service.store.attempts import service as attempts
from service.store.attempts.values import AttemptRef, TimelineUpdate
from service.store.checkpoints import service as checkpoints
from service.store.checkpoints import upload_service as uploads
from service.store.checkpoints.chunks import UploadHashes
from service.store.checkpoints.stores import make_stores
from service.store.checkpoints.values import UploadCommitted
from service.store.db import Database
from service.store.metrics import service as metrics
from service.store.models import JobEvent, Metric
from tests.uploads import requeue, running_job

CHUNK = 64 * 1024


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _shared(settings: Settings, job_id: int, step: int, data: bytes) -> dict[str, Any]:
    """A checkpoint file a rank sharing the API's filesystem wrote; the record's fields."""
    path = checkpoint_dir(settings.resolved_artifact_dir, job_id) / f"step-{step}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {
        "step": step,
        "epoch": 0,
        "path": str(path),
        "staged_path": None,
        "size_bytes": len(data),
        "sha256": _sha(data),
        "artifact_root": settings.resolved_artifact_dir,
        "store_kind": "filesystem",
    }


def _upload(
    db: Database, stores: Any, hashes: UploadHashes, ref: AttemptRef, step: int, data: bytes
) -> tuple[int, UploadCommitted]:
    """The whole upload protocol through the use cases, chunk by chunk: the upload's id and
    what its commit made."""
    begun = uploads.begin_upload(
        db, stores, ref, step=step, epoch=0, size_bytes=len(data), sha256=_sha(data),
        store_name="filesystem", chunk_bytes=CHUNK,
    )  # fmt: skip
    upload_id = begun.status.upload_id
    for offset in range(0, len(data), CHUNK):
        piece = data[offset : offset + CHUNK]
        receiver = uploads.open_chunk(
            db, stores, hashes, ref, upload_id, offset=offset, chunk_bytes=CHUNK
        )
        receiver.count(len(piece))
        receiver.write(piece)
        status = uploads.finish_chunk(db, ref, receiver, _sha(piece))
        assert status.received_bytes == offset + len(piece)
    return upload_id, checkpoints.commit_upload(
        db, stores, hashes, ref, upload_id, chunk_bytes=CHUNK
    )


def _files(settings: Settings, job_id: int) -> list[str]:
    return sorted(p.name for p in checkpoint_dir(settings.resolved_artifact_dir, job_id).iterdir())


def test_records_and_commits_share_one_sequence_and_the_store_deletes_what_it_let_go(
    settings: Settings, db: Database
) -> None:
    """keep_checkpoints=1: each new checkpoint, recorded or uploaded, lets the previous one go;
    its file is gone from the store once the use case returns (no caller deletes it)."""
    job_id = running_job(db, training={"keep_checkpoints": 1})
    ref = AttemptRef(job_id, 1)
    stores, hashes = make_stores(settings, db), UploadHashes()

    first = checkpoints.record_shared(db, stores, ref, **_shared(settings, job_id, 1, b"one"))
    assert dataclasses.is_dataclass(first) and first.step == 1 and first.store == "filesystem"
    assert _files(settings, job_id) == ["step-1.pt"]

    upload_id, done = _upload(db, stores, hashes, ref, 2, os.urandom(2 * CHUNK + 3))
    assert done.created and done.checkpoint.step == 2
    assert _files(settings, job_id) == [f"step-2.upload-{upload_id}.pt"], (
        "retention let step 1 go: the store deleted its file after the commit"
    )
    again = checkpoints.commit_upload(db, stores, hashes, ref, upload_id, chunk_bytes=CHUNK)
    assert not again.created and again.checkpoint == done.checkpoint, "a repeated commit"

    checkpoints.record_shared(db, stores, ref, **_shared(settings, job_id, 3, b"three"))
    assert _files(settings, job_id) == ["step-3.pt"], "the uploaded step 2 went the same way"
    listed = checkpoints.list_attempt_checkpoints(db, ref)
    assert [c.step for c in listed] == [3]
    with pytest.raises(dataclasses.FrozenInstanceError):
        listed[0].step = 4  # type: ignore[misc]
    assert [c.step for c in checkpoints.list_job_checkpoints(db, job_id, owner="alice")] == [3]


def _counts(db: Database, job_id: int) -> tuple[int, int]:
    with db.session(write=False) as s:
        events = s.scalar(select(func.count()).where(JobEvent.job_id == job_id))
        points = s.scalar(select(func.count()).where(Metric.job_id == job_id))
    return int(events or 0), int(points or 0)


def test_every_attempt_use_case_refuses_a_superseded_attempt(
    settings: Settings, db: Database
) -> None:
    """After a requeue, attempt 1's calls are refused as superseded (409) and change
    nothing: no event, no point, no checkpoint, no upload; attempt 2's go through."""
    job_id = running_job(db)
    stores = make_stores(settings, db)
    old, new = AttemptRef(job_id, 1), AttemptRef(job_id, 2)
    checkpoints.record_shared(db, stores, old, **_shared(settings, job_id, 1, b"one"))
    requeue(db, job_id)
    before = _counts(db, job_id)
    point = checked_point(MetricPoint("loss", 5, 0.5))
    calls: dict[str, Callable[[], object]] = {
        "describe_attempt": lambda: attempts.describe_attempt(
            db, stores, old, upload_store="filesystem"
        ),
        "record_timeline": lambda: attempts.record_timeline(db, old, TimelineUpdate(0)),
        "record_batch": lambda: metrics.record_batch(db, old, [point], progress={"step": 5}),
        "list_attempt_checkpoints": lambda: checkpoints.list_attempt_checkpoints(db, old),
        "note_failed_save": lambda: checkpoints.note_failed_save(db, old, step=2, reason="x"),
        "record_rank_note": lambda: checkpoints.record_rank_note(
            db, old, "upload_fallback", step=None, total_steps=None
        ),
        "delete_rank_checkpoints": lambda: checkpoints.delete_rank_checkpoints(
            db, stores, old, [1], damaged=True
        ),
        "open_resume_checkpoint": lambda: checkpoints.open_resume_checkpoint(db, stores, old, 1),
        "record_shared": lambda: checkpoints.record_shared(
            db, stores, old, **_shared(settings, job_id, 2, b"two")
        ),
        "begin_upload": lambda: uploads.begin_upload(
            db,
            stores,
            old,
            step=3,
            epoch=0,
            size_bytes=3,
            sha256=_sha(b"abc"),
            store_name="filesystem",
            chunk_bytes=CHUNK,
        ),
    }
    for name, call in calls.items():
        with pytest.raises(StaleAttemptError) as info:
            call()
        assert str(info.value.detail).startswith(f"{ATTEMPT_SUPERSEDED}: "), name
    assert _counts(db, job_id) == before, "a superseded attempt wrote nothing"
    assert [c.step for c in checkpoints.list_attempt_checkpoints(db, new)] == [1]

    described = attempts.describe_attempt(db, stores, new, upload_store="filesystem")
    assert (described.attempt, described.state.value, described.init_from) == (2, "running", None)
    assert described.store_id, "uploads go to the filesystem store: its id is told"
    assert metrics.record_batch(db, new, [point], progress=None) == 1
    page = metrics.read_metric_page(
        db, job_id, "loss", owner=None, after_step=0, limit=10, max_points=None,
        include_superseded=False, cap=1000,
    )  # fmt: skip
    assert [(p.step, p.value, p.attempt) for p in page.points] == [(5, 0.5, 2)]
    assert page.superseded is None and page.next_after_step == 5
