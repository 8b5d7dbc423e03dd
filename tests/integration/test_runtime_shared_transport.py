"""Rank 0 told ``DDPQ_CHECKPOINT_TRANSPORT=shared`` against the real attempt API (uvicorn on
loopback, SQLite and PostgreSQL): a rank that does not hold the API's store id falls back to
upload (its saves are not lost), and a record the server refuses is a failed save like any
other: a job event names the step, and a refused final save fails ``close`` (so the job)."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from service.core import artifacts
from service.core.config import Settings
from service.core.wire.attempt import STORE_ID_FILE
from service.store.checkpoints.crud import list_checkpoints
from service.store.db import Database
from service.store.jobs.crud import list_events
from tests.rank_api import LiveApi, attempt_client, live_api, running_job
from worker.runtime.checkpoints.files import CheckpointWriteError
from worker.runtime.checkpoints.saver import Checkpointer


@pytest.fixture
def api(db: Database, settings: Settings) -> Iterator[LiveApi]:
    with live_api(settings) as served:
        yield served


def state(step: int) -> dict[str, object]:
    return {"model": {"w": torch.full((16,), float(step))}, "step": step}


def live_steps(db: Database, job_id: int) -> list[int]:
    with db.session(write=False) as s:
        return [c.step for c in list_checkpoints(s, job_id)]


def reasons(db: Database, job_id: int) -> list[str]:
    with db.session(write=False) as s:
        return [e.reason or "" for e in list_events(s, job_id)]


def test_shared_without_the_apis_store_id_uploads_instead(
    db: Database, api: LiveApi, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    job_id, attempt = running_job(db)
    elsewhere = tmp_path / "not-the-api-dir"  # another host's artifact root
    client = attempt_client(db, api.url, job_id, attempt)
    ckpt = Checkpointer(client, elsewhere, job_id, attempt, keep=2, transport="shared")
    with caplog.at_level(logging.WARNING, logger="worker.runtime.checkpoints.transport"):
        ckpt.save(5, 0, lambda: state(5))
        assert ckpt.wait_uploaded(60)
    ckpt.close()
    assert ckpt.transport == "upload"
    assert "uploading instead" in caplog.text
    assert live_steps(db, job_id) == [5], "the save reached the API"
    assert sum("DDPQ_CHECKPOINT_TRANSPORT=shared" in r and "uploading instead" in r
               for r in reasons(db, job_id)) == 1, "the job's events say so"  # fmt: skip


def test_a_refused_record_is_a_failed_save_and_the_final_one_fails_close(
    db: Database, api: LiveApi, settings: Settings, tmp_path: Path
) -> None:
    """A directory holding a copy of the API's store id that the API does not read (a copied
    artifact root): every record names a file the server cannot find."""
    job_id, attempt = running_job(db)
    clone = tmp_path / "copied-root"
    clone.mkdir()
    client = attempt_client(db, api.url, job_id, attempt)
    assert client.self_check().store_id is not None  # the store writes its id when asked
    shutil.copy(settings.resolved_artifact_dir / STORE_ID_FILE, clone / STORE_ID_FILE)
    ckpt = Checkpointer(client, clone, job_id, attempt, keep=2, transport="shared")
    ckpt.save(3, 0, lambda: state(3))
    ckpt.wait()
    assert ckpt.transport == "shared"
    assert ckpt.last_saved is None
    ckpt.save(6, 0, lambda: state(6))  # the final one
    with pytest.raises(CheckpointWriteError, match="step 6"):
        ckpt.close()
    assert live_steps(db, job_id) == []
    found = reasons(db, job_id)
    for step in (3, 6):
        [event] = [r for r in found if r.startswith(f"checkpoint at step {step} not written")]
        assert "must upload" in event, event
    assert not artifacts.checkpoint_path(clone, job_id, 3).exists(), "an unrecorded file is none"
