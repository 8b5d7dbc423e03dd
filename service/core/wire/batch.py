"""The batch of small workspace files: many whole files in one request body (``POST
FILES_BATCH_PATH``, ``service.core.wire.workspace`` lists it with the other routes).

The body (``Content-Type: BATCH_CONTENT_TYPE``) is one line of JSON, a ``BatchHeader``
(``{"files": [{"sha256": …, "size_bytes": …}, …]}``) ended by ``\\n``, then the files' bytes
concatenated in the header's order, nothing between or after them: file *i* is the
``size_bytes`` bytes after the first *i*. The server checks each file's bytes against its
sha256 and keeps only those that match; the ``BatchAnswer`` says which files the caller now
has (``stored``) and which were refused and why (``refused``: send those again, e.g. with the
chunk protocol).

Why this framing and not multipart/form-data: the sizes in the header are the boundaries, so
the server splits the body by slicing (no boundary scan over 16 MiB of bytes in Python, no
per-part headers, no multipart parser dependency), the client builds it with one
``b"".join``, and a file's bytes can be anything (a multipart boundary must not occur in
them). A body whose bytes do not add up to the header's sizes is refused whole (422).

Caps: at most ``BATCH_MAX_FILES`` files, each at most ``BATCH_FILE_MAX_BYTES``, the header
line at most ``BATCH_HEADER_MAX_BYTES``, and the files' bytes at most the server's chunk cap
(``DDPQ_CHECKPOINT_CHUNK_BYTES``, 16 MiB by default: 413 beyond it, before the body is read
when ``Content-Length`` says so). A client starts at ``BATCH_MAX_BYTES`` and halves its
batches on a 413.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.core.errors import DdpqError
from service.core.wire.attempt import DEFAULT_CHUNK_BYTES
from service.core.wire.workspace import FileRef, Sha256

# The route names the framing; the media type is the standard one for raw bytes (a made-up
# one would be opaque to OpenAPI tools: schemathesis cannot send it).
BATCH_CONTENT_TYPE = "application/octet-stream"
# Files per batch: the header stays ~100 KB, and one batch is one transaction's rows.
BATCH_MAX_FILES = 1000
# The largest file a batch carries; larger ones go with the chunk protocol (one file's
# bytes then outweigh its three requests).
BATCH_FILE_MAX_BYTES = 1 << 20
# The header line's cap: ~95 bytes of JSON per file, with room to spare.
BATCH_HEADER_MAX_BYTES = 256 << 10
# A client's first budget of file bytes per batch: the server's default chunk cap.
BATCH_MAX_BYTES = DEFAULT_CHUNK_BYTES


class BatchFramingError(DdpqError):
    """A batch body that cannot be split into its files (422): no header line, a header that
    is not a ``BatchHeader``, or bytes that do not add up to the header's sizes."""

    status_code = 422
    code = "invalid_batch"


class BatchTooLargeError(DdpqError):
    """A batch body over the server's cap (413): its files' bytes over the chunk cap, or
    more than ``BATCH_HEADER_MAX_BYTES`` of header on top. Send smaller batches."""

    status_code = 413
    code = "batch_too_large"


def too_large_message(chunk_bytes: int) -> str:
    """What a 413 for a batch says, on a server whose chunk cap is ``chunk_bytes``."""
    return (
        f"a batch may carry at most {chunk_bytes} bytes of files (DDPQ_CHECKPOINT_CHUNK_BYTES) "
        f"and a header line of at most {BATCH_HEADER_MAX_BYTES} bytes: send smaller batches"
    )


def batch_body_cap(chunk_bytes: int) -> int:
    """The most bytes a batch body may have on a server whose chunk cap is ``chunk_bytes``:
    the files' bytes, plus the header line and its newline."""
    return chunk_bytes + BATCH_HEADER_MAX_BYTES + 1


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BatchHeader(_Wire):
    """The batch body's first line: the files that follow, in order."""

    files: list[FileRef] = Field(min_length=1, max_length=BATCH_MAX_FILES)


class BatchRefusal(_Wire):
    """A file of the batch not stored: its sha256 and why (``reason``, for a person)."""

    sha256: Sha256
    reason: str


class BatchAnswer(_Wire):
    """What became of a batch: the sha256 of each file the caller now has (sent now, or had
    before), each once, in the header's order; and each file refused (nothing kept of it)."""

    stored: list[str]
    refused: list[BatchRefusal]


def encode_batch(files: Sequence[tuple[FileRef, bytes]]) -> bytes:
    """The body of a batch of ``files``: ``(ref, data)`` pairs, ``data`` the file's bytes."""
    header = BatchHeader(files=[ref for ref, _ in files]).model_dump_json()
    return b"".join([header.encode(), b"\n", *(data for _, data in files)])


def split_batch(body: bytes, max_file_bytes: int) -> list[tuple[FileRef, bytes]]:
    """The ``(ref, data)`` pairs of a batch body, ``data`` the bytes at the place the
    header's sizes give (not yet checked against the sha256: the server does that).

    Args:
        body: the whole body (at most ``batch_body_cap(max_file_bytes)`` bytes).
        max_file_bytes: the most bytes the files may have together (the chunk cap).

    Raises:
        BatchTooLargeError: the files have more than ``max_file_bytes`` bytes together.
        BatchFramingError: no header line within ``BATCH_HEADER_MAX_BYTES``, a header that
            is not a ``BatchHeader``, or a body longer or shorter than the sizes add up to.
    """
    end = body.find(b"\n", 0, BATCH_HEADER_MAX_BYTES + 1)
    if end < 0:
        raise BatchFramingError(
            f"a batch starts with one line of JSON (at most {BATCH_HEADER_MAX_BYTES} bytes) "
            "listing its files, ended by a newline: none found"
        )
    try:
        header = BatchHeader.model_validate_json(body[:end])
    except ValidationError as exc:
        raise BatchFramingError(f"the batch's header line is not a BatchHeader: {exc}") from None
    view = memoryview(body)[end + 1 :]
    declared = sum(ref.size_bytes for ref in header.files)
    if max(declared, len(view)) > max_file_bytes:
        raise BatchTooLargeError(too_large_message(max_file_bytes))
    if declared != len(view):
        raise BatchFramingError(
            f"the batch's files add up to {declared} bytes but {len(view)} follow the header: "
            "each file's bytes must follow in the header's order, nothing else"
        )
    files: list[tuple[FileRef, bytes]] = []
    at = 0
    for ref in header.files:
        files.append((ref, bytes(view[at : at + ref.size_bytes])))
        at += ref.size_bytes
    return files
