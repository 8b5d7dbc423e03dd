"""Uploading a packed workspace with the real ``DdpqClient`` over a fake of the workspace
routes (``tests.workspace_api``, at the HTTP boundary): only what the API lacks is sent, in
chunks with their sha256, resuming from the server's offset."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.core.wire.batch import BATCH_FILE_MAX_BYTES
from service.core.wire.chunks import MAX_CHUNK_REFUSALS, FileShrankError
from service.workspaces import upload as upload_module
from service.workspaces.pack import pack_workspace
from service.workspaces.upload import WorkspaceUploadError, upload_packed
from tests.workspace_api import FakeWorkspaceApi

LIMITS = {"max_bytes": 100 * 2**20, "max_files": 20_000}


def tree(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.py").write_text("print('epoch')\n")
    (root / "pkg").mkdir(exist_ok=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "model.py").write_text("W = 1\n")
    # Over what a batch carries: it goes in chunks (17 of 64 KiB).
    (root / "weights.bin").write_bytes(os.urandom(BATCH_FILE_MAX_BYTES + 1))
    return root


def test_an_unchanged_directory_uploads_nothing_and_one_edit_uploads_one_file(
    tmp_path: Path,
) -> None:
    api = FakeWorkspaceApi()
    root = tree(tmp_path / "w")
    client = api.client()
    first = client.upload_workspace(root)
    assert (first.sent_files, first.file_count) == (4, 4)
    assert first.sent_bytes == api.chunk_bytes_received == first.total_bytes
    assert client.get_workspace(first.digest).digest() == first.digest

    again = client.upload_workspace(root)
    assert (again.sent_files, again.sent_bytes, again.digest) == (0, 0, first.digest)
    assert api.chunk_bytes_received == first.total_bytes

    (root / "pkg" / "model.py").write_text("W = 2  # tuned\n")
    sent: list[str] = []
    edited = client.upload_workspace(root, on_file=lambda path, size: sent.append(path))
    assert sent == ["pkg/model.py"] and edited.sent_files == 1
    assert edited.sent_bytes == len("W = 2  # tuned\n") and edited.digest != first.digest


def test_big_files_go_in_chunks_and_resume_after_damage_or_a_lost_answer(tmp_path: Path) -> None:
    api = FakeWorkspaceApi(chunk_bytes=64 * 2**10)
    root = tree(tmp_path / "w")
    packed = pack_workspace(root, **LIMITS)
    big = next(f for f in packed.manifest.files if f.path == "weights.bin")
    # The small files go first, in one batch: the faults are weights.bin's chunks.
    api.faults = [None, "corrupt", "corrupt", "offset", None]
    result = upload_packed(api.client(), packed)
    assert api.files[big.sha256] == (root / "weights.bin").read_bytes()
    assert result.sent_files == 4
    assert sum(1 for r in api.requests if r[1].endswith("/files/batch")) == 1
    chunk_puts = [r for r in api.requests if r[1].endswith("/chunks")]
    # weights.bin: 17 chunks of at most 64 KiB; the second refused twice as damaged, then
    # taken but its answer lost (409 with the server's offset: the third goes next).
    assert len(chunk_puts) == -(-big.size_bytes // 2**16) + 2


def test_small_files_go_in_batches_of_a_few_and_alone_when_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches of at most BATCH_MAX_FILES files; a file a batch refused goes again alone,
    in chunks, and is counted once."""
    monkeypatch.setattr(upload_module, "BATCH_MAX_FILES", 4)
    api = FakeWorkspaceApi()
    root = tmp_path / "w"
    root.mkdir()
    for i in range(10):
        (root / f"f{i}.txt").write_text(f"file {i}")
    packed = pack_workspace(root, **LIMITS)
    api.batch_refuses = {packed.manifest.files[3].sha256}
    sent: list[str] = []
    result = upload_packed(api.client(), packed, on_file=lambda path, size: sent.append(path))
    assert (result.sent_files, result.sent_bytes) == (10, packed.manifest.total_bytes)
    assert sorted(sent) == sorted(f.path for f in packed.manifest.files)
    assert sum(1 for r in api.requests if r[1].endswith("/files/batch")) == 3  # 4 + 4 + 2
    assert [r for r in api.requests if r[1].endswith("/chunks")] == [
        ("PUT", f"/api/v1/workspaces/files/{len(api.uploads)}/chunks")
    ], "the refused file alone, in one chunk (the last upload begun)"
    assert set(api.files) == {f.sha256 for f in packed.manifest.files}


def test_an_api_with_a_lower_cap_gets_batches_halved_until_they_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(upload_module, "BATCH_MAX_BYTES", 1_000_000)
    api = FakeWorkspaceApi()
    api.batch_max_bytes = 300_000  # a 413 beyond, as a lower DDPQ_CHECKPOINT_CHUNK_BYTES
    root = tmp_path / "w"
    root.mkdir()
    for i in range(10):
        (root / f"f{i}.bin").write_bytes(os.urandom(100_000))
    sent: list[str] = []
    result = api.client().upload_workspace(root, on_file=lambda path, size: sent.append(path))
    assert (result.sent_files, result.sent_bytes) == (10, 1_000_000)
    assert sorted(sent) == [f"f{i}.bin" for i in range(10)], "each file told once"
    batches = sum(1 for r in api.requests if r[1].endswith("/files/batch"))
    assert batches == 2 + 5, "1 MB and 500 kB refused (413), then five of 200 kB"
    assert not any(r[1].endswith("/chunks") for r in api.requests)


def test_chunks_refused_again_and_again_fail_the_upload_saying_so(tmp_path: Path) -> None:
    api = FakeWorkspaceApi()
    root = tmp_path / "w"
    root.mkdir()
    (root / "a.bin").write_bytes(b"x" * (BATCH_FILE_MAX_BYTES + 1))  # in chunks
    api.faults = ["corrupt"] * MAX_CHUNK_REFUSALS
    with pytest.raises(WorkspaceUploadError, match=r"5 chunks in a row refused.*run again"):
        api.client().upload_workspace(root)
    assert api.workspaces == {}
    # Run again: the upload resumes and completes.
    assert api.client().upload_workspace(root).sent_files == 1


def test_empty_and_duplicate_files_are_sent_once(tmp_path: Path) -> None:
    api = FakeWorkspaceApi()
    root = tmp_path / "w"
    (root / "a").mkdir(parents=True)
    for name in ("a/__init__.py", "b.py", "c.py"):
        (root / name).write_text("")
    (root / "same1.txt").write_text("same")
    (root / "same2.txt").write_text("same")
    result = api.client().upload_workspace(root)
    assert (result.file_count, result.sent_files, result.sent_bytes) == (5, 2, 4)
    assert b"" in api.files.values() and api.files_committed == 2


def test_missing_is_asked_in_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upload_module, "MAX_MISSING_FILES", 3)
    api = FakeWorkspaceApi()
    root = tmp_path / "w"
    root.mkdir()
    for i in range(7):
        (root / f"f{i}.txt").write_text(str(i))
    assert api.client().upload_workspace(root).sent_files == 7
    assert sum(1 for r in api.requests if r[1].endswith("/missing")) == 3


def test_a_file_that_changed_after_packing_is_refused_by_its_batch_then_at_commit(
    tmp_path: Path,
) -> None:
    api = FakeWorkspaceApi()
    root = tmp_path / "w"
    root.mkdir()
    (root / "a.txt").write_text("before")
    packed = pack_workspace(root, **LIMITS)
    (root / "a.txt").write_text("after!")  # same size, other bytes
    with pytest.raises(WorkspaceUploadError, match=r"not what was packed"):
        upload_packed(api.client(), packed)


def test_client_run_packs_uploads_and_submits_a_command_job(tmp_path: Path) -> None:
    api = FakeWorkspaceApi()
    root = tree(tmp_path / "w")
    client = api.client()
    plan = client.run(["torchrun", "--nproc-per-node=2", "train.py", "--epochs", "1"],
                      workdir=root, env={"LR": "0.1"}, overrides={"max_restarts": 1},
                      dry_run=True)  # fmt: skip
    assert plan["spec"]["command"] == ["train.py", "--epochs", "1"]
    assert api.uploads == {} and api.chunk_bytes_received == 0  # a dry run sends no file
    job = client.run(["python", "train.py"], workdir=root, nnodes=1, gpus_per_node=0)
    spec = api.jobs[job["id"]]["spec"]
    assert spec == {
        "name": "train.py",
        "command": ["train.py"],
        "workspace": pack_workspace(root, **LIMITS).digest,
        "resources": {"nnodes": 1, "gpus_per_node": 0},
    }
    assert spec["workspace"] in api.workspaces and api.files_committed == 4


def test_a_file_that_shrank_after_packing_is_refused_saying_so(tmp_path: Path) -> None:
    api = FakeWorkspaceApi()
    root = tmp_path / "w"
    root.mkdir()
    (root / "a.txt").write_text("a longer text")
    packed = pack_workspace(root, **LIMITS)
    (root / "a.txt").write_text("short")
    with pytest.raises(FileShrankError, match=r"ended at byte 5 of 13: it changed"):
        upload_packed(api.client(), packed)


def test_an_api_whose_cap_no_batch_fits_gets_every_file_alone(tmp_path: Path) -> None:
    api = FakeWorkspaceApi()
    api.batch_max_bytes = 1000  # below the smallest budget a client halves to (64 KiB)
    root = tmp_path / "w"
    root.mkdir()
    for i in range(3):
        (root / f"f{i}.bin").write_bytes(os.urandom(800))
    sent: list[str] = []
    result = api.client().upload_workspace(root, on_file=lambda path, size: sent.append(path))
    assert (result.sent_files, result.sent_bytes) == (3, 2400)
    assert sorted(sent) == ["f0.bin", "f1.bin", "f2.bin"], "each file told once"
    assert sum(1 for r in api.requests if r[1].endswith("/chunks")) == 3
    batches = sum(1 for r in api.requests if r[1].endswith("/files/batch"))
    assert batches == 9, "16 MiB halved down to 64 KiB: nine 413s, then one by one"
