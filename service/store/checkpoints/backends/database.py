"""The database checkpoint store: checkpoint bytes as rows of ``checkpoint_chunks``, one row
per uploaded chunk (up to ``DDPQ_CHECKPOINT_CHUNK_BYTES``, 16 MiB by default), keyed by the
upload's id and the chunk's byte offset. A committed file keeps its upload's rows; its
``location`` is the upload id. For small models and CI, where "checkpoints in the database"
is all the storage there is; ``max_bytes`` caps one file. Workspace files use the same store
over their own table (``chunks=WorkspaceChunk``: upload ids of the two kinds overlap).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import TypeAlias

from sqlalchemy import delete, func, select

from service.core.errors import NotFoundError
from service.store.checkpoints.backends.base import (
    READ_BLOCK_BYTES,
    CheckpointStoreError,
    UploadKey,
)
from service.store.db import Database
from service.store.models import CheckpointChunk, WorkspaceChunk

# A table of chunk rows: ``upload_id``, ``offset_bytes``, ``data``.
ChunkTable: TypeAlias = type[CheckpointChunk] | type[WorkspaceChunk]


class _RowChunk:
    """A chunk collected in memory (one row's worth, at most the chunk cap) and inserted on
    ``commit``, replacing any rows at or beyond its offset in the same transaction."""

    def __init__(self, db: Database, chunks: ChunkTable, upload_id: int, offset: int) -> None:
        self._db, self._upload_id, self._offset = db, upload_id, offset
        self._chunks = chunks
        self._data = bytearray()

    def write(self, data: bytes) -> None:
        self._data += data

    def commit(self) -> None:
        with self._db.session() as session:
            chunks = self._chunks
            session.execute(
                delete(chunks).where(
                    chunks.upload_id == self._upload_id,
                    chunks.offset_bytes >= self._offset,
                )
            )
            if self._data:
                session.add(
                    chunks(
                        upload_id=self._upload_id,
                        offset_bytes=self._offset,
                        data=bytes(self._data),
                    )
                )
        self._data = bytearray()

    def abort(self) -> None:
        self._data = bytearray()


class DatabaseStore:
    """Bytes in ``chunks`` rows of ``db`` (``checkpoint_chunks`` unless told otherwise)."""

    name = "database"

    def __init__(
        self, db: Database, *, max_bytes: int, chunks: ChunkTable = CheckpointChunk
    ) -> None:
        self.db = db
        self.max_bytes = max_bytes
        self.chunks = chunks

    def max_size_bytes(self) -> int | None:
        return self.max_bytes

    def _extents(self, upload_id: int) -> list[tuple[int, int]]:
        """``(offset, length)`` of each row of ``upload_id``, in order (no data read)."""
        with self.db.session(write=False) as session:
            rows = session.execute(
                select(self.chunks.offset_bytes, func.length(self.chunks.data))
                .where(self.chunks.upload_id == upload_id)
                .order_by(self.chunks.offset_bytes)
            ).all()
        return [(int(o), int(n)) for o, n in rows]

    def _contiguous_end(self, upload_id: int) -> int:
        end = 0
        for offset, length in self._extents(upload_id):
            if offset != end:
                break
            end = offset + length
        return end

    def _rows(self, upload_id: int, start: int) -> Iterator[bytes]:
        """The bytes of ``upload_id`` from ``start``, one row fetched at a time."""
        for offset, length in self._extents(upload_id):
            if offset + length <= start:
                continue
            with self.db.session(write=False) as session:
                data = session.scalar(
                    select(self.chunks.data).where(
                        self.chunks.upload_id == upload_id,
                        self.chunks.offset_bytes == offset,
                    )
                )
            if data is None:  # deleted meanwhile
                raise CheckpointStoreError(f"checkpoint rows of upload {upload_id} went away")
            view = memoryview(data)[max(0, start - offset) :]
            for i in range(0, len(view), READ_BLOCK_BYTES):
                yield bytes(view[i : i + READ_BLOCK_BYTES])

    def begin(self, key: UploadKey) -> None:
        return None  # the upload's row is all there is to start

    def open_chunk(self, key: UploadKey, offset: int) -> _RowChunk:
        held = self._contiguous_end(key.upload_id)
        if held < offset:
            raise CheckpointStoreError(
                f"upload {key.upload_id} holds {held} bytes, not {offset}: resume from GET status"
            )
        return _RowChunk(self.db, self.chunks, key.upload_id, offset)

    def received_size(self, key: UploadKey) -> int:
        return self._contiguous_end(key.upload_id)

    def partial_sha256(self, key: UploadKey) -> str:
        digest = hashlib.sha256()
        for block in self._rows(key.upload_id, 0):
            digest.update(block)
        return digest.hexdigest()

    def finalize(self, key: UploadKey) -> str:
        return str(int(key.upload_id))

    def put_files(self, files: Sequence[tuple[UploadKey, bytes]]) -> list[str]:
        # One row per non-empty file (an empty one has none, as after its upload), all in
        # one transaction: the batch's bytes are there together or not at all.
        with self.db.session() as session:
            session.add_all(
                self.chunks(upload_id=key.upload_id, offset_bytes=0, data=data)
                for key, data in files
                if data
            )
        return [self.finalize(key) for key, _ in files]

    @staticmethod
    def _upload_id(location: str) -> int:
        if not location.isdigit():
            raise NotFoundError("checkpoint file not found")
        return int(location)

    def open_read(self, location: str, start: int = 0) -> Iterator[bytes]:
        upload_id = self._upload_id(location)
        if start > 0 and self._contiguous_end(upload_id) < start:
            raise NotFoundError("checkpoint file not found")
        return self._rows(upload_id, start)

    def size(self, location: str) -> int | None:
        # No rows reads as missing: an empty file would have none either, which is why
        # an upload of zero bytes is refused at begin (``UploadStart.size_bytes`` ≥ 1).
        try:
            upload_id = self._upload_id(location)
        except NotFoundError:
            return None
        return self._contiguous_end(upload_id) if self._extents(upload_id) else None

    def delete(self, location: str) -> None:
        if location.isdigit():
            self._delete_rows(int(location))

    def discard(self, key: UploadKey) -> None:
        self._delete_rows(key.upload_id)

    def _delete_rows(self, upload_id: int) -> None:
        with self.db.session() as session:
            session.execute(delete(self.chunks).where(self.chunks.upload_id == upload_id))
