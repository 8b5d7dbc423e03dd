"""Rank 0's checkpoints across hosts that share no filesystem, against the real attempt API
(uvicorn on loopback, SQLite and PostgreSQL): the transport ``auto`` picks, the upload commits
the row only with the whole file, a resume on a host without the file downloads and verifies
it (falling back to the previous one), and a cut download resumes with ``Range``."""

from __future__ import annotations

import hashlib
import io
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from torch import nn

from service.core import artifacts
from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.core.wire import attempt as wire
from service.store.checkpoints.crud import list_checkpoints
from service.store.db import Database
from tests.rank_api import LiveApi, attempt_client, live_api, running_job
from worker.runtime.attempt_client import AttemptClient
from worker.runtime.checkpoints.fetch import (
    CheckpointFetchError,
    fetch_file,
    find_resume_checkpoint,
)
from worker.runtime.checkpoints.files import file_sha256, load_checkpoint_file
from worker.runtime.checkpoints.saver import Checkpointer
from worker.runtime.checkpoints.transport import local_store_id, resolve_transport


@pytest.fixture
def api(db: Database, settings: Settings) -> Iterator[LiveApi]:
    with live_api(settings) as served:
        yield served


@pytest.fixture
def job(db: Database) -> tuple[int, int]:
    spec = JobSpec.model_validate(
        {"name": "t", "task": "regression", "training": {"keep_checkpoints": 2}}
    )
    return running_job(db, spec)


def state_of(step: int) -> dict[str, object]:
    torch.manual_seed(step)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    return {"model": model.state_dict(), "step": step, "epoch": 0, "batch_idx": step}


def save_all(ckpt: Checkpointer, steps: list[int]) -> None:
    for step in steps:
        ckpt.save(step, 0, lambda step=step: state_of(step))  # type: ignore[misc]
        assert ckpt.wait_uploaded(60)
    ckpt.close()


def test_auto_shares_only_a_directory_holding_the_apis_store_id(
    db: Database, settings: Settings, api: LiveApi, job: tuple[int, int], tmp_path: Path
) -> None:
    me = attempt_client(db, api.url, *job).self_check()
    assert me.store_id is not None, "the filesystem store names its id"
    api_dir = settings.resolved_artifact_dir
    assert local_store_id(api_dir) == me.store_id, "the API writes its store id when it starts"
    assert resolve_transport("auto", api_dir, me.store_id) == "shared"
    assert resolve_transport("auto", tmp_path / "elsewhere", me.store_id) == "upload"
    assert resolve_transport("auto", api_dir, None) == "upload"  # a database store
    assert resolve_transport("shared", api_dir, me.store_id) == "shared"
    assert resolve_transport("shared", tmp_path, me.store_id) == "upload"  # not shared: falls back
    with pytest.raises(ValueError, match="auto, shared, upload"):
        resolve_transport("ftp", tmp_path, None)


def test_upload_commits_whole_files_and_a_resume_elsewhere_downloads_them(
    db: Database, api: LiveApi, job: tuple[int, int], tmp_path: Path
) -> None:
    """Rank 0 on host A (its own directory) uploads steps 1..3; the service lists the
    committed ones it keeps (keep_checkpoints 2) with A's sha256, A prunes its local copy of
    step 1; host B (an empty directory) resumes from step 3,
    downloaded and verified; a damaged copy on B is replaced by a fresh download."""
    job_id, attempt = job
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    ckpt = Checkpointer(
        attempt_client(db, api.url, *job), host_a, job_id, attempt, keep=2, transport="auto"
    )
    save_all(ckpt, [1, 2, 3])
    assert ckpt.transport == "upload" and ckpt.failed == []
    assert ckpt.last_saved is not None and ckpt.last_saved.step == 3
    with db.session(write=False) as s:
        rows = {c.step: c.sha256 for c in list_checkpoints(s, job_id)}
    local = artifacts.checkpoint_path(host_a, job_id, 3)
    assert rows == {3: file_sha256(local), 2: rows[2]}, "newest 2 committed, as A wrote them"
    assert not artifacts.checkpoint_path(host_a, job_id, 1).exists(), "A prunes what's gone"

    client = attempt_client(db, api.url, *job)
    assert find_resume_checkpoint(client, host_b, job_id, attempt) == 3
    fetched = artifacts.checkpoint_path(host_b, job_id, 3)
    assert file_sha256(fetched) == rows[3]
    assert load_checkpoint_file(fetched, torch.device("cpu"))["step"] == 3
    assert not list(artifacts.attempt_dir(host_b, job_id, attempt).glob(".download-*"))

    fetched.write_bytes(b"damaged")
    assert find_resume_checkpoint(client, host_b, job_id, attempt) == 3
    assert file_sha256(fetched) == rows[3]


def test_a_host_sharing_the_api_store_resumes_from_an_uploaded_file(
    db: Database, settings: Settings, api: LiveApi, job: tuple[int, int], tmp_path: Path
) -> None:
    """Host A uploads steps 1..3; the next attempt runs where the API's directory is its own
    (transport shared): it finds the uploaded file under the upload's own name, links
    ``step-3.pt`` to it, and loads it; the link goes when retention lets the file go."""
    job_id, attempt = job
    ckpt = Checkpointer(
        attempt_client(db, api.url, *job), tmp_path / "host-a", job_id, attempt, keep=2,
        transport="upload",
    )  # fmt: skip
    save_all(ckpt, [1, 2, 3])
    api_dir = settings.resolved_artifact_dir
    client = attempt_client(db, api.url, *job)
    assert find_resume_checkpoint(client, api_dir, job_id, attempt) == 3, "not taken for damaged"
    linked = artifacts.checkpoint_path(api_dir, job_id, 3)
    assert linked.is_symlink() and load_checkpoint_file(linked, torch.device("cpu"))["step"] == 3
    with db.session(write=False) as s:
        assert sorted(c.step for c in list_checkpoints(s, job_id)) == [2, 3]

    ckpt = Checkpointer(client, tmp_path / "host-a", job_id, attempt, keep=2, transport="upload")
    save_all(ckpt, [4, 5])  # keep 2: step 3 goes, and with it the link to it
    assert not linked.is_symlink() and not linked.exists()


def test_a_truncated_stored_checkpoint_is_dropped_at_once_and_the_previous_one_used(
    db: Database, settings: Settings, api: LiveApi, job: tuple[int, int], tmp_path: Path
) -> None:
    """The API's copy of step 3 shrank after its commit: a resume elsewhere is told so before
    any byte (410), records step 3 deleted (no retries of a file that can never verify) and
    resumes from step 2."""
    job_id, attempt = job
    ckpt = Checkpointer(
        attempt_client(db, api.url, *job), tmp_path / "host-a", job_id, attempt, keep=2,
        transport="upload",
    )  # fmt: skip
    save_all(ckpt, [1, 2, 3])
    [stored] = artifacts.checkpoint_dir(settings.resolved_artifact_dir, job_id).glob("step-3.*")
    with stored.open("r+b") as f:
        f.truncate(1000)
    client = attempt_client(db, api.url, *job)
    assert find_resume_checkpoint(client, tmp_path / "host-b", job_id, attempt) == 2
    with db.session(write=False) as s:
        assert [c.step for c in list_checkpoints(s, job_id)] == [2], "step 3 recorded deleted"


def test_a_cut_download_resumes_with_range_and_bad_bytes_are_refused(tmp_path: Path) -> None:
    """Over a fake server (our interface, httpx.MockTransport): the first answer is cut after
    1000 bytes, the next request asks ``Range: bytes=1000-``; a file whose bytes do not match
    the recorded sha256 is never put in place."""
    payload = bytes(range(256)) * 40
    ranges: list[str | None] = []

    class CutStream(httpx.SyncByteStream):
        def __init__(self, data: bytes) -> None:
            self.data = data

        def __iter__(self) -> Iterator[bytes]:
            yield self.data[:1000]
            raise httpx.ReadError("connection reset")

    def serve(request: httpx.Request) -> httpx.Response:
        asked = request.headers.get("Range")
        ranges.append(asked)
        start = int(asked.removeprefix("bytes=").rstrip("-")) if asked else 0
        if not asked:
            return httpx.Response(200, stream=CutStream(payload))
        return httpx.Response(206, content=payload[start:])

    client = AttemptClient("http://api.test", "ddpqa_x", transport=httpx.MockTransport(serve))
    dest = tmp_path / "ckpt" / "step-1.pt"
    sha = hashlib.sha256(payload).hexdigest()
    fetch_file(client, "/x", dest, size_bytes=len(payload), sha256=sha, tmp_dir=tmp_path / "a")
    assert dest.read_bytes() == payload and ranges == [None, "bytes=1000-"]

    other = tmp_path / "ckpt" / "step-2.pt"
    with pytest.raises(CheckpointFetchError, match="does not match"):
        fetch_file(client, "/x", other, size_bytes=len(payload), sha256="0" * 64,
                   tmp_dir=tmp_path / "a")  # fmt: skip
    assert not other.exists() and not list((tmp_path / "a").iterdir())


def test_download_streams_into_the_file_object(tmp_path: Path) -> None:
    """``AttemptClient.download`` writes the body as it arrives (the file object grows), and
    reads the sha256 header."""
    body = b"x" * (3 * 2**20 + 5)

    def serve(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={wire.SHA256_HEADER: "ab" * 32})

    client = AttemptClient("http://api.test", "ddpqa_x", transport=httpx.MockTransport(serve))
    out = io.BytesIO()
    assert client.download("/x", out) == "ab" * 32
    assert out.getvalue() == body


def test_the_uploader_rides_out_an_api_restart_and_a_corrupted_chunk(
    db: Database, settings: Settings, job: tuple[int, int], tmp_path: Path
) -> None:
    """The real API with small chunks (64 KiB) flips a byte of its 3rd chunk (refused, sent
    again) and is stopped mid-upload, then started again on the same port: the uploader backs
    off, asks where the upload stands and goes on; nothing is listed until the commit, then
    exactly the file rank 0 wrote."""
    from sqlalchemy import select

    from service.store.models import CheckpointUpload
    from worker.runtime.checkpoints.uploader import CheckpointUploader, UploadItem

    served = LiveApi(
        settings.model_copy(
            update={"checkpoint_chunk_bytes": 64 * 2**10, "checkpoint_corrupt_chunk_n": 3}
        )
    )
    served.start()
    data = bytes(range(256)) * (12 * 2**12)  # 12 MiB: 192 chunks
    path = tmp_path / "host-a" / "step-5.pt"
    path.parent.mkdir()
    path.write_bytes(data)
    item = UploadItem(5, 0, path, len(data), hashlib.sha256(data).hexdigest())
    committed: list[int] = []
    failed: list[tuple[int, str]] = []
    uploader = CheckpointUploader(
        attempt_client(db, served.url, *job),
        on_committed=lambda it: committed.append(it.step),
        on_failed=lambda step, why: failed.append((step, why)),
        on_stale=lambda why: failed.append((-1, why)),
    )

    def received() -> int:
        with db.session(write=False) as s:
            return int(s.scalar(select(CheckpointUpload.received_bytes)) or 0)

    try:
        uploader.submit(item)
        deadline = time.monotonic() + 60
        while received() < 2 * 2**20 and time.monotonic() < deadline:
            time.sleep(0.01)
        served.stop()
        with db.session(write=False) as s:
            assert list_checkpoints(s, job[0]) == [], "a partial upload is never listed"
        assert 0 < received() < len(data), "stopped mid-upload"
        time.sleep(1.0)
        served.start()
        assert uploader.wait_idle(120)
    finally:
        uploader.close()
        served.stop()
    assert committed == [5] and failed == []
    with db.session(write=False) as s:
        [row] = list_checkpoints(s, job[0])
    assert (row.step, row.sha256, row.size_bytes) == (5, item.sha256, len(data))
