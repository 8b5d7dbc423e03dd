"""The client's half of the chunked upload protocol (``service.core.wire.attempt`` describes it):
send a file's bytes from the server's ``received_bytes`` on, one chunk per request, and go on
from whatever status the server answers. One loop for every kind of upload: rank 0's
checkpoints (``worker.runtime.checkpoints.uploader``) and workspace files
(``service.workspaces.upload``). What to do about an error stays with the caller (a rank backs
off and retries within a deadline; the CLI gives up and says how to resume).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import BinaryIO, Protocol, TypeVar

from service.core.errors import DdpqError
from service.core.wire.attempt import MIN_CHUNK_BYTES

RECEIVING = "receiving"
# Damaged chunks (422) in a row before an upload fails: a link that corrupts every chunk.
MAX_CHUNK_REFUSALS = 5


class FileShrankError(DdpqError):
    """The file ended before the size its upload was begun with: it changed meanwhile."""

    status_code = 409
    code = "file_changed"


class ChunkStatus(Protocol):
    """What the loop reads of an upload's status (``UploadStatus``, ``FileUploadStatus``)."""

    @property
    def upload_id(self) -> int: ...
    @property
    def received_bytes(self) -> int: ...
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def state(self) -> str: ...


S = TypeVar("S", bound=ChunkStatus)


def usable_chunk_bytes(reported: int, known: int) -> int:
    """The chunk size to send with: ``reported`` (a status's ``chunk_bytes``) when it is one
    the server could be configured with (≥ ``MIN_CHUNK_BYTES``), else ``known`` (the last
    usable one): a status saying 0 must not shrink every chunk to a byte."""
    return reported if reported >= MIN_CHUNK_BYTES else known


def send_file_chunks(
    fh: BinaryIO,
    status: S,
    size_bytes: int,
    send: Callable[[int, int, bytes], S],
    recover: Callable[[Exception, S], S],
    *,
    before_chunk: Callable[[], None] | None = None,
    on_accepted: Callable[[int], None] | None = None,
) -> tuple[S, int]:
    """Send ``fh``'s bytes ``[status.received_bytes, size_bytes)`` in chunks.

    Args:
        fh: the file, opened for binary reading and seekable (each chunk is read at its
            offset: after an error the server's status says where to go on).
        status: the upload's status as begun (or resumed).
        size_bytes: the file's size, as the upload was begun with.
        send: ``send(upload_id, offset, data)`` → the status after the chunk.
        recover: called with an exception ``send`` raised and the status before it; returns
            the status to go on from (an offset mismatch: the server's; a damaged chunk: the
            same, to send it again) or raises to stop.
        before_chunk: called before each chunk (a deadline or cancel check that raises).
        on_accepted: called with the byte count of each chunk the server took.

    Raises:
        FileShrankError: the file ended before ``size_bytes``.
        Whatever ``recover`` or ``before_chunk`` raise.

    Returns:
        The last status (``committed`` or ``abandoned`` stop the loop early; else every byte
        arrived and the caller commits) and the bytes the server took.
    """
    sent = 0
    # The status the upload began (or resumed) with sets the size; later ones only when they
    # tell a size a server could have (a lost compare-and-set's 409 once said 0).
    chunk = status.chunk_bytes if status.chunk_bytes > 0 else MIN_CHUNK_BYTES
    while status.state == RECEIVING and status.received_bytes < size_bytes:
        if before_chunk is not None:
            before_chunk()
        offset = status.received_bytes
        fh.seek(offset)
        chunk = usable_chunk_bytes(status.chunk_bytes, chunk)
        data = fh.read(min(chunk, size_bytes - offset))
        if not data:
            raise FileShrankError(
                f"{getattr(fh, 'name', 'the file')} ended at byte {offset} of {size_bytes}: "
                "it changed while it was being sent"
            )
        try:
            status = send(status.upload_id, offset, data)
        except Exception as exc:
            status = recover(exc, status)
            continue
        sent += len(data)
        if on_accepted is not None:
            on_accepted(len(data))
    return status, sent
