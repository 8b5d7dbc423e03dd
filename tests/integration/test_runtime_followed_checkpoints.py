"""A command job's followed checkpoint file against the real attempt API (uvicorn on loopback,
SQLite and PostgreSQL): ``Checkpointer.save_file`` copies the script's file at the call and
records it (shared) or uploads it (upload) with its ``file_name``; a source that vanished is a
failed save, not an exception; ``restore_followed`` puts the newest matching one back on a
host that has none of the files, falls back to the previous one when the newest is damaged,
and finds nothing for a job without followed checkpoints (which ordinary resume ignores)."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from service.core import artifacts
from service.core.config import Settings
from service.store.checkpoints.crud import list_checkpoints
from service.store.db import Database
from service.store.jobs.crud import list_events
from tests.rank_api import LiveApi, attempt_client, live_api, running_job
from worker.runtime.checkpoints.fetch import CheckpointFetchError, find_resume_checkpoint
from worker.runtime.checkpoints.followed import RestoredFile, restore_followed
from worker.runtime.checkpoints.saver import Checkpointer


@pytest.fixture
def api(db: Database, settings: Settings) -> Iterator[LiveApi]:
    with live_api(settings) as served:
        yield served


@pytest.fixture
def job(db: Database) -> tuple[int, int]:
    return running_job(db)


def rows(db: Database, job_id: int) -> dict[int, tuple[str | None, str]]:
    """The job's live checkpoints: step → (file_name, sha256)."""
    with db.session(write=False) as s:
        return {c.step: (c.file_name, c.sha256) for c in list_checkpoints(s, job_id)}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def version(n: int) -> bytes:
    """The bytes of the script's nth save (a real torch file, as the tutorial writes)."""
    torch.manual_seed(n)
    buf = io.BytesIO()
    torch.save({"epoch": n, "w": torch.randn(2000)}, buf)
    return buf.getvalue()


def checkpointer(db: Database, api: LiveApi, job: tuple[int, int], host: Path,
                 transport: str) -> Checkpointer:  # fmt: skip
    return Checkpointer(
        attempt_client(db, api.url, *job), host, job[0], job[1], keep=3, transport=transport
    )


def save_versions(
    ckpt: Checkpointer, workspace: Path, saves: list[tuple[int, str]]
) -> dict[int, bytes]:
    """The script writes each (step, file name) in turn; rank 0 saves each; returns what each
    step's file held when it was saved."""
    saved = {}
    for step, name in saves:
        path = workspace / name
        path.parent.mkdir(parents=True, exist_ok=True)
        saved[step] = version(step)
        path.write_bytes(saved[step])
        ckpt.save_file(step, step // 10, path, name)
        path.write_bytes(b"the next epoch overwrote it")  # the copy was taken at the call
        assert ckpt.wait_uploaded(60)
    return saved


def test_save_file_records_a_copy_with_its_file_name_on_a_shared_filesystem(
    db: Database, settings: Settings, api: LiveApi, job: tuple[int, int], tmp_path: Path
) -> None:
    ckpt = checkpointer(db, api, job, settings.resolved_artifact_dir, "auto")
    saved = save_versions(ckpt, tmp_path / "workspace", [(10, "snapshot.pt")])
    ckpt.close()
    assert ckpt.transport == "shared" and ckpt.failed == []
    assert rows(db, job[0]) == {10: ("snapshot.pt", sha(saved[10]))}
    stored = artifacts.checkpoint_path(settings.resolved_artifact_dir, job[0], 10)
    assert stored.read_bytes() == saved[10], "the version at the call, renamed into place"
    assert ckpt.last_saved is not None and ckpt.last_saved.step == 10


def test_save_file_uploads_a_copy_with_its_file_name(
    db: Database, api: LiveApi, job: tuple[int, int], tmp_path: Path
) -> None:
    ckpt = checkpointer(db, api, job, tmp_path / "host-a", "upload")
    saves = [(10, "ckpt/epoch-1.pt"), (20, "ckpt/epoch-2.pt")]
    saved = save_versions(ckpt, tmp_path / "workspace", saves)
    ckpt.close()
    assert ckpt.transport == "upload" and ckpt.failed == []
    assert rows(db, job[0]) == {
        10: ("ckpt/epoch-1.pt", sha(saved[10])),
        20: ("ckpt/epoch-2.pt", sha(saved[20])),
    }


@pytest.mark.parametrize("transport", ["auto", "upload"])
def test_a_vanished_source_is_skipped_not_a_failure(
    db: Database, settings: Settings, api: LiveApi, job: tuple[int, int], tmp_path: Path,
    transport: str,
) -> None:  # fmt: skip
    """A followed file gone before its copy (the script deleted it, or a newer version is
    being written) is no checkpoint and no failure: the next version is taken."""
    ckpt = checkpointer(db, api, job, settings.resolved_artifact_dir, transport)
    ckpt.save_file(10, 0, tmp_path / "workspace" / "snapshot.pt", "snapshot.pt")
    assert ckpt.wait_uploaded(60)
    assert ckpt.failed == []
    with db.session(write=False) as s:
        reasons = [e.reason or "" for e in list_events(s, job[0])]
    assert not any("vanished" in r for r in reasons), reasons
    assert rows(db, job[0]) == {}
    ckpt.close()  # nothing asked for failed


def test_restore_puts_the_newest_matching_version_back_on_a_new_host(
    db: Database, api: LiveApi, job: tuple[int, int], tmp_path: Path
) -> None:
    """Host A saves three versions of ckpt/*.pt and one other file; host B, with none of
    them, gets the newest version of every ckpt/*.pt name in its fresh workspace."""
    ckpt = checkpointer(db, api, job, tmp_path / "host-a", "upload")
    saves = [(10, "ckpt/e1.pt"), (20, "ckpt/e2.pt"), (30, "ckpt/e1.pt"), (40, "notes.bin")]
    saved = save_versions(ckpt, tmp_path / "workspace-a", saves)
    ckpt.close()
    root = tmp_path / "workspace-b"
    root.mkdir()
    client = attempt_client(db, api.url, *job)
    restored = restore_followed(client, tmp_path / "host-b", job[0], job[1], root, "ckpt/*.pt")
    assert restored == RestoredFile(30, "ckpt/e1.pt", root / "ckpt" / "e1.pt")
    assert (root / "ckpt" / "e1.pt").read_bytes() == saved[30]
    assert torch.load(root / "ckpt" / "e1.pt")["epoch"] == 30, "the script loads it as is"
    assert (root / "ckpt" / "e2.pt").read_bytes() == saved[20], "every matching name"
    names = sorted(p.name for p in root.rglob("*"))
    assert names == ["ckpt", "e1.pt", "e2.pt"], "no temp file left, no other file"
    assert find_resume_checkpoint(client, tmp_path / "host-c", *job) is None, (
        "followed files are not ddpq's own checkpoints: an ordinary resume skips them"
    )


def test_a_damaged_newest_version_falls_back_to_the_previous_one(
    db: Database, settings: Settings, api: LiveApi, job: tuple[int, int], tmp_path: Path
) -> None:
    ckpt = checkpointer(db, api, job, tmp_path / "host-a", "upload")
    saves = [(10, "snapshot.pt"), (20, "snapshot.pt")]
    saved = save_versions(ckpt, tmp_path / "workspace-a", saves)
    ckpt.close()
    [stored] = artifacts.checkpoint_dir(settings.resolved_artifact_dir, job[0]).glob("step-20.*")
    with stored.open("r+b") as f:
        f.truncate(100)  # the API's copy of step 20 shrank behind its back
    root = tmp_path / "workspace-b"
    root.mkdir()
    client = attempt_client(db, api.url, *job)
    restored = restore_followed(client, tmp_path / "host-b", job[0], job[1], root, "snapshot.pt")
    assert restored is not None and restored.step == 10
    assert (root / "snapshot.pt").read_bytes() == saved[10]
    assert list(rows(db, job[0])) == [10], "step 20 recorded deleted"

    [stored] = artifacts.checkpoint_dir(settings.resolved_artifact_dir, job[0]).glob("step-10.*")
    with stored.open("r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointFetchError, match="could be brought"):
        restore_followed(client, tmp_path / "host-c", job[0], job[1], root, "snapshot.pt")


def test_a_job_without_followed_checkpoints_restores_nothing(
    db: Database, api: LiveApi, job: tuple[int, int], tmp_path: Path
) -> None:
    client = attempt_client(db, api.url, *job)
    root = tmp_path / "workspace"
    root.mkdir()
    assert restore_followed(client, tmp_path / "host", job[0], job[1], root, "snapshot.pt") is None
    ckpt = checkpointer(db, api, job, tmp_path / "host-a", "upload")
    ckpt.save(5, 0, lambda: {"w": torch.zeros(4)})  # ddpq's own checkpoint, no file name
    ckpt.save_file(6, 0, _written(root / "other.pt"), "other.pt")  # another followed file
    assert ckpt.wait_uploaded(60)
    ckpt.close()
    assert restore_followed(client, tmp_path / "host", job[0], job[1], root, "snapshot.pt") is None
    assert not (root / "snapshot.pt").exists()


def _written(path: Path) -> Path:
    path.write_bytes(version(6))
    return path
