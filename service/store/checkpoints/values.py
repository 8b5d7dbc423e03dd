"""The values checkpoint use cases hand out and their building blocks pass around: plain,
frozen, no ORM row (``service.store.checkpoints.service`` builds them inside its sessions)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from service.store.checkpoints.backends.base import UploadKey


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A committed checkpoint: ``step`` (global step), ``epoch`` (0-based), the ``attempt``
    that wrote it, ``path`` as stored (absolute, or relative to the artifact root),
    ``size_bytes``, ``sha256`` (hex), the ``store`` holding its bytes, when it was
    recorded (``created_at``, tz-aware UTC) and, for a followed checkpoint, the workspace
    ``file_name`` it is a version of (None for ddpq's own)."""

    step: int
    epoch: int
    attempt: int
    path: str
    size_bytes: int
    sha256: str
    store: str
    created_at: datetime
    file_name: str | None = None


@dataclass(frozen=True, slots=True)
class StoredFile:
    """What serving one checkpoint's bytes needs: the ``store`` that holds them, their
    ``location`` there, the recorded ``size_bytes`` and ``sha256`` (hex)."""

    store: str
    location: str
    size_bytes: int
    sha256: str


@dataclass(frozen=True, slots=True)
class DoomedFile:
    """Bytes to remove from a store after the transaction that let them go committed."""

    job_id: int
    step: int
    store: str
    location: str


@dataclass(frozen=True, slots=True)
class PendingDiscard:
    """A partial upload whose bytes its store should drop (after the transaction)."""

    store: str
    key: UploadKey


@dataclass(frozen=True, slots=True)
class UploadStatus:
    """Where an upload stands (the wire's ``UploadStatus``): the next chunk goes at
    ``received_bytes`` of ``size_bytes``, at most ``chunk_bytes`` long; ``state`` is
    ``receiving``, ``committed`` or ``abandoned``."""

    upload_id: int
    step: int
    size_bytes: int
    received_bytes: int
    chunk_bytes: int
    state: str


@dataclass(frozen=True, slots=True)
class UploadBegun:
    """A begun upload's status; ``created`` False when this attempt began the same
    ``(step, sha256)`` before (resume it at ``status.received_bytes``)."""

    status: UploadStatus
    created: bool


@dataclass(frozen=True, slots=True)
class UploadCommitted:
    """The checkpoint an upload became; ``created`` False for a repeated commit."""

    checkpoint: CheckpointInfo
    created: bool
