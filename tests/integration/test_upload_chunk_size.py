"""The chunk size an upload goes on with after a conflict: the server's 409 for a lost
compare-and-set tells its real chunk size (SQLite and PostgreSQL), and the rank never shrinks
its chunks on a status telling a size no server could have."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from service.core.wire import attempt as wire
from service.store.checkpoints.uploads import UploadStateError, advance_upload, begin_upload
from service.store.db import Database
from tests.uploads import running_job
from worker.runtime.attempt_client import UploadOffsetError
from worker.runtime.checkpoints.uploader import CheckpointUploader, UploadItem

CHUNK = 64 * 1024


def test_a_lost_compare_and_set_tells_the_real_chunk_size(db: Database) -> None:
    job_id = running_job(db)
    with db.session() as s:
        upload, _, _ = begin_upload(s, job_id, 1, step=5, epoch=0, size_bytes=3 * CHUNK,
                                    sha256="ab" * 32, store="filesystem")  # fmt: skip
        upload_id = upload.id
    with db.session() as s:  # the winner
        advance_upload(s, job_id, 1, upload_id, offset=0, length=CHUNK, chunk_bytes=CHUNK)
    with db.session() as s, pytest.raises(UploadStateError) as lost:  # the loser, same offset
        advance_upload(s, job_id, 1, upload_id, offset=0, length=CHUNK, chunk_bytes=CHUNK)
    assert lost.value.detail["chunk_bytes"] == CHUNK
    assert lost.value.detail["received_bytes"] == CHUNK


class ZeroChunkStatusApi:
    """A server whose first chunk loses a race: the chunk is stored by the winner, and the
    loser's 409 says ``chunk_bytes`` 0 (what the API once answered)."""

    def __init__(self, size: int, chunk: int) -> None:
        self.size, self.chunk = size, chunk
        self.data = bytearray()
        self.chunks: list[int] = []
        self.committed: list[str] = []

    def _status(self, chunk_bytes: int, state: str = "receiving") -> wire.UploadStatus:
        return wire.UploadStatus(upload_id=1, step=3, size_bytes=self.size,
                                 received_bytes=len(self.data), chunk_bytes=chunk_bytes,
                                 state=state)  # fmt: skip

    def begin_upload(self, start: wire.UploadStart) -> wire.UploadStatus:
        return self._status(self.chunk)

    def upload_status(self, upload_id: int) -> wire.UploadStatus:
        return self._status(self.chunk)

    def send_chunk(self, upload_id: int, offset: int, data: bytes) -> wire.UploadStatus:
        self.chunks.append(len(data))
        assert len(data) <= self.chunk and offset == len(self.data)
        self.data += data
        if len(self.chunks) == 1:
            raise UploadOffsetError(self._status(0))
        return self._status(self.chunk)

    def commit_upload(self, upload_id: int) -> wire.CheckpointEntry:
        sha = hashlib.sha256(bytes(self.data)).hexdigest()
        self.committed.append(sha)
        return wire.CheckpointEntry(step=3, epoch=0, attempt=1, path="x",
                                    size_bytes=len(self.data), sha256=sha)  # fmt: skip


def test_the_rank_keeps_its_chunk_size_after_a_status_saying_zero(tmp_path: Path) -> None:
    data = bytes(i % 251 for i in range(5 * CHUNK))
    path = tmp_path / "step-3.pt"
    path.write_bytes(data)
    api = ZeroChunkStatusApi(len(data), CHUNK)
    committed: list[int] = []
    uploader = CheckpointUploader(
        api,  # type: ignore[arg-type]
        on_committed=lambda item: committed.append(item.step),
        on_failed=lambda step, reason: pytest.fail(reason),
        on_stale=lambda reason: pytest.fail(reason),
    )
    uploader.submit(UploadItem(3, 0, path, len(data), hashlib.sha256(data).hexdigest()))
    assert uploader.wait_idle(60)
    uploader.close()
    assert committed == [3] and api.committed == [hashlib.sha256(data).hexdigest()]
    assert api.chunks == [CHUNK] * 5, "whole chunks, never one byte at a time"
