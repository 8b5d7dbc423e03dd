"""The values workspace use cases hand out: plain, frozen, no ORM row. A stored file to serve
is the checkpoints' ``StoredFile`` (one streaming path for both kinds of bytes)."""

from __future__ import annotations

from dataclasses import dataclass

from service.store.checkpoints.values import StoredFile as StoredFile  # for the routes


@dataclass(frozen=True, slots=True)
class FileUploadState:
    """Where a workspace file's upload stands (the wire's ``FileUploadStatus``): the next chunk
    goes at ``received_bytes`` of ``size_bytes``, at most ``chunk_bytes`` long; ``state`` is
    ``receiving``, ``committed`` or ``abandoned``."""

    upload_id: int
    sha256: str
    size_bytes: int
    received_bytes: int
    chunk_bytes: int
    state: str


@dataclass(frozen=True, slots=True)
class FileUploadBegun:
    """A begun upload's state; ``created`` False when it was begun before (resume it) or the
    owner already has the file (``committed``)."""

    status: FileUploadState
    created: bool


@dataclass(frozen=True, slots=True)
class WorkspaceStored:
    """A stored workspace: ``digest``, ``file_count``, ``total_bytes``; ``created`` False when
    the owner had stored this digest before."""

    digest: str
    file_count: int
    total_bytes: int
    created: bool


@dataclass(frozen=True, slots=True)
class WorkspacesReaped:
    """What one retention pass deleted: workspaces, files, and uploads (abandoned or stale)."""

    workspaces: int
    files: int
    uploads: int


@dataclass(frozen=True, slots=True)
class BatchStored:
    """What became of a batch of small files (the wire's ``BatchAnswer``): ``stored``, the
    sha256 of each file the owner now has, in the order sent; ``refused``, ``(sha256,
    reason)`` of each file not kept."""

    stored: list[str]
    refused: list[tuple[str, str]]
