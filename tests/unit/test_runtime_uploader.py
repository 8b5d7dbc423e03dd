"""The checkpoint uploader (worker.runtime.checkpoints.uploader) against an in-memory fake of
the attempt API's upload routes (our own interface, ``UploadClient``): chunks with resume by
offset after errors, a damaged chunk sent again, only the newest waiting checkpoint sent, a
deadline that fails the save instead of hanging, the fence. The real routes:
tests/e2e/test_checkpoint_hosts.py.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest
import torch

from service.core.errors import StaleAttemptError
from service.core.wire import attempt as wire
from worker.attempt import stop_upload_marker
from worker.runtime.attempt_client import (
    ApiUnavailableError,
    AttemptRequestError,
    UploadOffsetError,
)
from worker.runtime.checkpoints import uploader as up
from worker.runtime.checkpoints.files import CheckpointWriteError
from worker.runtime.checkpoints.saver import Checkpointer
from worker.runtime.checkpoints.uploader import CheckpointUploader, UploadItem

CHUNK = 1000


class FakeUploads:
    """The upload routes in memory. ``faults`` is a list of what the next calls do: ``"down"``
    (ApiUnavailableError), ``"corrupt"`` (the chunk's 422), ``"lost"`` (the chunk is stored but
    the answer is lost), ``"stale"`` (409 superseded); ``gate`` blocks every chunk until set."""

    def __init__(self) -> None:
        self.uploads: dict[int, dict[str, object]] = {}
        self.data: dict[int, bytearray] = {}
        self.committed: list[tuple[int, str]] = []
        self.begun: list[int] = []
        self.faults: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.chunks_sent = 0

    def _fault(self) -> str | None:
        return self.faults.pop(0) if self.faults else None

    def _status(self, upload_id: int) -> wire.UploadStatus:
        u = self.uploads[upload_id]
        return wire.UploadStatus(
            upload_id=upload_id, step=int(u["step"]), size_bytes=int(u["size"]),  # type: ignore[call-overload]
            received_bytes=len(self.data[upload_id]), chunk_bytes=CHUNK, state=str(u["state"]),
        )  # fmt: skip

    def begin_upload(self, start: wire.UploadStart) -> wire.UploadStatus:
        fault = self._fault()
        if fault == "down":
            raise ApiUnavailableError("down")
        if fault == "stale":
            raise StaleAttemptError("attempt superseded")
        for uid, u in self.uploads.items():
            if (u["step"], u["sha"]) == (start.step, start.sha256):
                return self._status(uid)
        uid = len(self.uploads) + 1
        self.uploads[uid] = {"step": start.step, "size": start.size_bytes, "sha": start.sha256,
                             "state": "receiving"}  # fmt: skip
        self.data[uid] = bytearray()
        self.begun.append(start.step)
        return self._status(uid)

    def upload_status(self, upload_id: int) -> wire.UploadStatus:
        if self.faults and self.faults[0] == "down":
            self.faults.pop(0)
            raise ApiUnavailableError("down")
        return self._status(upload_id)

    def send_chunk(self, upload_id: int, offset: int, data: bytes) -> wire.UploadStatus:
        self.gate.wait()
        self.chunks_sent += 1
        fault = self._fault()
        if fault == "down":
            raise ApiUnavailableError("down")
        if fault == "corrupt":
            raise AttemptRequestError("422 chunk does not match its sha256")
        if offset != len(self.data[upload_id]):
            raise UploadOffsetError(self._status(upload_id))
        assert len(data) <= CHUNK
        self.data[upload_id] += data
        if fault == "lost":
            raise ApiUnavailableError("answer lost")
        return self._status(upload_id)

    def commit_upload(self, upload_id: int) -> wire.CheckpointEntry:
        u = self.uploads[upload_id]
        sha = hashlib.sha256(bytes(self.data[upload_id])).hexdigest()
        if sha != u["sha"]:
            raise AttemptRequestError("422 sha256 mismatch")
        u["state"] = "committed"
        self.committed.append((int(u["step"]), sha))  # type: ignore[call-overload]
        return wire.CheckpointEntry(step=int(u["step"]), epoch=0, attempt=1, path="x",  # type: ignore[call-overload]
                                    size_bytes=len(self.data[upload_id]), sha256=sha)  # fmt: skip


class Outcomes:
    def __init__(self) -> None:
        self.committed: list[int] = []
        self.failed: list[tuple[int, str]] = []
        self.stale: list[str] = []

    def uploader(self, api: FakeUploads) -> CheckpointUploader:
        return CheckpointUploader(
            api,
            on_committed=lambda item: self.committed.append(item.step),
            on_failed=lambda step, reason: self.failed.append((step, reason)),
            on_stale=self.stale.append,
        )


def item_of(tmp_path: Path, step: int, size: int = 4500) -> UploadItem:
    data = bytes((step * 7 + i) % 251 for i in range(size))
    path = tmp_path / f"step-{step}.pt"
    path.write_bytes(data)
    return UploadItem(step, 0, path, size, hashlib.sha256(data).hexdigest())


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up, "RETRY_MIN_S", 0.001)
    monkeypatch.setattr(up, "RETRY_MAX_S", 0.01)


def test_a_file_goes_in_chunks_and_is_committed_with_its_sha256(tmp_path: Path) -> None:
    api, out = FakeUploads(), Outcomes()
    item = item_of(tmp_path, 5)
    uploader = out.uploader(api)
    uploader.submit(item)
    uploader.close()
    assert out.committed == [5] and not out.failed
    assert api.committed == [(5, item.sha256)]
    assert api.chunks_sent == 5  # 4500 bytes in chunks of at most chunk_bytes (1000)


def test_errors_resume_from_the_servers_offset_and_a_damaged_chunk_is_sent_again(
    tmp_path: Path,
) -> None:
    """An outage at the start, a chunk whose answer was lost (stored, then resumed past it), a
    refused (damaged) chunk, an outage while asking for the status: all retried, the file
    arrives whole, exactly once."""
    api, out = FakeUploads(), Outcomes()
    api.faults = ["down", None, "lost", "corrupt", "down", "down"]
    item = item_of(tmp_path, 3)
    uploader = out.uploader(api)
    uploader.submit(item)
    uploader.close()
    assert out.committed == [3], out.failed
    assert api.committed == [(3, item.sha256)]
    assert bytes(api.data[1]) == item.path.read_bytes()


def test_a_chunk_refused_again_and_again_fails_the_save(tmp_path: Path) -> None:
    api, out = FakeUploads(), Outcomes()
    api.faults = [None] + ["corrupt"] * up.MAX_CHUNK_REFUSALS
    uploader = out.uploader(api)
    uploader.submit(item_of(tmp_path, 4))
    uploader.close()
    assert out.committed == [] and api.committed == []
    [(step, reason)] = out.failed
    assert step == 4 and "refused" in reason, reason


def test_only_the_newest_waiting_checkpoint_goes(tmp_path: Path) -> None:
    """While step 1 uploads, steps 2 and 3 are submitted: 2 never goes, 3 does."""
    api, out = FakeUploads(), Outcomes()
    api.gate.clear()
    uploader = out.uploader(api)
    uploader.submit(item_of(tmp_path, 1))
    while api.begun != [1]:
        threading.Event().wait(0.01)
    assert uploader.submit(item_of(tmp_path, 2)) is None
    replaced = uploader.submit(item_of(tmp_path, 3))
    assert replaced is not None and replaced.step == 2
    api.gate.set()
    assert uploader.wait_idle(30)
    uploader.close()
    assert api.begun == [1, 3] and out.committed == [1, 3]


def test_closing_with_a_newer_one_waiting_gives_up_the_one_in_flight(tmp_path: Path) -> None:
    """At the end of training the final checkpoint matters: the older upload in flight stops
    at its next chunk and the final one goes."""
    api, out = FakeUploads(), Outcomes()
    api.gate.clear()
    uploader = out.uploader(api)
    uploader.submit(item_of(tmp_path, 1))
    while api.begun != [1]:
        threading.Event().wait(0.01)
    uploader.submit(item_of(tmp_path, 2))
    closer = threading.Thread(target=uploader.close)
    closer.start()
    api.gate.set()
    closer.join(30)
    assert not closer.is_alive()
    assert out.committed == [2] and api.begun == [1, 2] and not out.failed


def test_an_upload_past_its_deadline_fails_the_save_naming_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that stops answering (every call: unavailable): never a hang; the save fails
    with a reason that names the step and the deadline, and the uploader takes the next one."""
    monkeypatch.setattr(up, "UPLOAD_FLOOR_S", 0.3)
    api, out = FakeUploads(), Outcomes()
    api.faults = ["down"] * 10_000
    uploader = out.uploader(api)
    uploader.submit(item_of(tmp_path, 7))
    assert uploader.wait_idle(30)
    [(step, reason)] = out.failed
    assert step == 7 and "deadline" in reason and "step 7" in reason, reason
    api.faults = []
    uploader.submit(item_of(tmp_path, 8))
    uploader.close()
    assert out.committed == [8]


def test_the_fence_stops_the_uploader(tmp_path: Path) -> None:
    api, out = FakeUploads(), Outcomes()
    api.faults = ["stale"]
    uploader = out.uploader(api)
    uploader.submit(item_of(tmp_path, 2))
    uploader.close()
    assert out.stale and out.committed == [] and out.failed == []


def test_deadline_grows_with_size_over_the_measured_bandwidth() -> None:
    assert up.upload_deadline_s(1, 1e6) == up.UPLOAD_FLOOR_S
    big = 10 * 2**30
    assert up.upload_deadline_s(big, 100e6) == pytest.approx(big / 100e6 * up.UPLOAD_SAFETY)


class FakeAttemptApi(FakeUploads):
    """The rest of what the Checkpointer calls (recorded, not served)."""

    def __init__(self) -> None:
        super().__init__()
        self.failures: list[wire.CheckpointFailure] = []

    def record_checkpoint_failure(self, failure: wire.CheckpointFailure) -> None:
        self.failures.append(failure)

    def list_checkpoints(self) -> list[wire.CheckpointEntry]:
        return []

    def close(self) -> None:
        pass


def test_a_stopped_rank_waits_for_its_stop_upload_only_so_long_and_says_so(
    tmp_path: Path,
) -> None:
    """After a stop signal rank 0 waits for the stop checkpoint's upload at most
    ``stop_upload_s``, keeping the marker file that holds the local launcher's SIGKILL
    meanwhile; past it the save is recorded failed (a job event naming the step) and
    ``close`` raises, so the job is not reported finished with its checkpoint."""
    api = FakeAttemptApi()
    api.gate.clear()  # the upload never gets through
    ckpt = Checkpointer(
        api, tmp_path, 9, 1, keep=2, transport="upload",  # type: ignore[arg-type]
        stopping=lambda: True, stop_upload_s=0.5,
    )  # fmt: skip
    marker = stop_upload_marker(tmp_path, 9, 1)
    seen: list[bool] = []
    watcher = threading.Thread(
        target=lambda: seen.extend(marker.exists() or threading.Event().wait(0.05)
                                   for _ in range(100) if not seen or not seen[-1]),
    )  # fmt: skip
    ckpt.save(12, 0, lambda: {"model": {"w": torch.zeros(3)}, "step": 12})
    watcher.start()
    with pytest.raises(CheckpointWriteError, match="step 12"):
        ckpt.close()
    api.gate.set()
    watcher.join(10)
    assert True in seen, "the marker file was there while rank 0 waited"
    assert not marker.exists(), "and is gone once it stopped waiting"
    [failure] = api.failures
    assert failure.step == 12 and "stop checkpoint" in failure.reason, failure
