"""The rows of workspaces, their files and the files' uploads, within a caller's session.

Every lookup is by owner: another owner's workspace, file or upload is absent (the same 404),
and a file another owner uploaded is missing for you. An upload is ``receiving`` while chunks
arrive (``received_bytes`` advanced by one compare-and-set per chunk), then ``committed`` in
the transaction that writes its ``workspace_files`` row, or ``abandoned``.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any, cast

from pydantic import ValidationError
from sqlalchemy import CursorResult, select, update
from sqlalchemy.orm import Session

from service.core.errors import DdpqError, NotFoundError, SpecValidationError
from service.core.owners.quotas import QuotaLimits
from service.core.wire.workspace import Manifest
from service.store.checkpoints.uploads import UploadStateError
from service.store.models import Workspace, WorkspaceFile, WorkspaceUpload, utcnow
from service.store.quotas import check_uploads_in_flight, check_workspace_room

RECEIVING, COMMITTED, ABANDONED = "receiving", "committed", "abandoned"
# sha256 values per IN (...) list: well below every driver's bound on parameters.
IN_BATCH = 2000
# Not-uploaded files a 422 lists one by one (the rest are counted).
MISSING_LISTED = 50


class WorkspaceNotFoundError(NotFoundError):
    """No workspace with this digest for this owner (another owner's answers alike)."""

    code = "workspace_not_found"


class WorkspaceUploadNotFoundError(DdpqError):
    """No such workspace file upload of the caller (another owner's answers alike)."""

    status_code = 404
    code = "not_found"


class WorkspaceFilesMissingError(DdpqError):
    """A manifest names files the owner has not uploaded: ``detail`` lists them, one
    ``{loc, msg, type}`` per file (``loc`` points into the request body)."""

    status_code = 422
    code = "workspace_files_missing"


class WorkspaceFileInputError(DdpqError):
    """A workspace file upload whose bytes cannot be accepted (its sha256 does not match)."""

    status_code = 422
    code = "invalid_workspace_file"


def upload_fields(upload: WorkspaceUpload, chunk_bytes: int) -> dict[str, Any]:
    """The upload as the wire's ``FileUploadStatus`` fields."""
    return {
        "upload_id": upload.id,
        "sha256": upload.sha256,
        "size_bytes": upload.size_bytes,
        "received_bytes": upload.received_bytes,
        "chunk_bytes": chunk_bytes,
        "state": upload.state,
    }


def find_file(session: Session, owner: str, sha256: str) -> WorkspaceFile | None:
    """The owner's file with this content, or None."""
    return session.scalars(
        select(WorkspaceFile).where(WorkspaceFile.owner == owner, WorkspaceFile.sha256 == sha256)
    ).one_or_none()


def present_sha256s(session: Session, owner: str, sha256s: Iterable[str]) -> set[str]:
    """Which of ``sha256s`` the owner has as committed files."""
    return set(present_sizes(session, owner, sha256s))


def present_sizes(session: Session, owner: str, sha256s: Iterable[str]) -> dict[str, int]:
    """The size in bytes of each of ``sha256s`` the owner has as a committed file."""
    wanted = sorted(set(sha256s))
    found: dict[str, int] = {}
    for i in range(0, len(wanted), IN_BATCH):
        rows = session.execute(
            select(WorkspaceFile.sha256, WorkspaceFile.size_bytes).where(
                WorkspaceFile.owner == owner,
                WorkspaceFile.sha256.in_(wanted[i : i + IN_BATCH]),
            )
        )
        found.update((sha256, size) for sha256, size in rows)
    return found


def touch_files(
    session: Session,
    owner: str,
    sha256s: Iterable[str],
    at: datetime,
    *,
    older_than: datetime | None = None,
) -> None:
    """Move the owner's files' ``last_used_at`` to ``at`` (retention's clock); with
    ``older_than``, only where it is older than that (fewer writes)."""
    wanted = sorted(set(sha256s))
    for i in range(0, len(wanted), IN_BATCH):
        where = [WorkspaceFile.owner == owner, WorkspaceFile.sha256.in_(wanted[i : i + IN_BATCH])]
        if older_than is not None:
            where.append(WorkspaceFile.last_used_at < older_than)
        session.execute(
            update(WorkspaceFile)
            .where(*where)
            .values(last_used_at=at)
            .execution_options(synchronize_session=False)
        )


def begin_upload(
    session: Session,
    owner: str,
    *,
    sha256: str,
    size_bytes: int,
    store: str,
    limits: QuotaLimits | None = None,
) -> tuple[WorkspaceUpload, bool]:
    """The upload of ``(owner, sha256)``: the committed one of a file the owner has, else one
    begun before and still receiving, else a new one (``created`` True), which must fit the
    owner's workspace bytes and uploads in flight (``limits``).

    Raises:
        QuotaExceededError: a new upload over a quota (413 bytes, 429 uploads in flight).
    """
    held = find_file(session, owner, sha256)
    if held is not None:
        return session.get_one(WorkspaceUpload, held.upload_id), False
    existing = session.scalars(
        select(WorkspaceUpload)
        .where(
            WorkspaceUpload.owner == owner,
            WorkspaceUpload.sha256 == sha256,
            WorkspaceUpload.size_bytes == size_bytes,
            WorkspaceUpload.state == RECEIVING,
        )
        .order_by(WorkspaceUpload.id.desc())
        .limit(1)
    ).one_or_none()
    if existing is not None:
        return existing, False
    if limits is not None:
        check_workspace_room(session, owner, adding=size_bytes, limits=limits)
        check_uploads_in_flight(session, owner, limit=limits.uploads_in_flight_per_owner)
    now = utcnow()
    upload = WorkspaceUpload(
        owner=owner, sha256=sha256, size_bytes=size_bytes, received_bytes=0, state=RECEIVING,
        store=store, created_at=now, updated_at=now,
    )  # fmt: skip
    session.add(upload)
    session.flush()
    return upload, True


def get_upload(session: Session, owner: str, upload_id: int) -> WorkspaceUpload:
    """The owner's upload ``upload_id``.

    Raises:
        WorkspaceUploadNotFoundError: none, or another owner's (404).
    """
    upload = session.get(WorkspaceUpload, upload_id)
    if upload is None or upload.owner != owner:
        raise WorkspaceUploadNotFoundError(f"workspace file upload {upload_id} not found")
    return upload


def reconcile_received(session: Session, upload: WorkspaceUpload, held_bytes: int) -> None:
    """Lower ``received_bytes`` to what the store really holds (never raise it)."""
    if upload.state == RECEIVING and held_bytes < upload.received_bytes:
        session.execute(
            update(WorkspaceUpload)
            .where(
                WorkspaceUpload.id == upload.id,
                WorkspaceUpload.received_bytes == upload.received_bytes,
            )
            .values(received_bytes=held_bytes)
            .execution_options(synchronize_session=False)
        )
        upload.received_bytes = held_bytes


def check_offset(upload: WorkspaceUpload, offset: int, chunk_bytes: int) -> None:
    """Raise unless a chunk (or, at ``size_bytes``, the commit) may go at ``offset`` now.

    Raises:
        UploadStateError: not receiving, or ``offset`` is not ``received_bytes`` (409, the
            status in ``detail``).
    """
    if upload.state != RECEIVING or offset != upload.received_bytes:
        raise UploadStateError(upload_fields(upload, chunk_bytes))


def advance_upload(
    session: Session, owner: str, upload_id: int, *, offset: int, length: int, chunk_bytes: int
) -> WorkspaceUpload:
    """Count a stored chunk: ``received_bytes`` from ``offset`` to ``offset + length``, one
    compare-and-set (a concurrent chunk at the same offset loses).

    Raises:
        WorkspaceUploadNotFoundError: no such upload of the owner (404).
        UploadStateError: the upload moved meanwhile (409, its status in ``detail``).
    """
    result = session.execute(
        update(WorkspaceUpload)
        .where(
            WorkspaceUpload.id == upload_id,
            WorkspaceUpload.owner == owner,
            WorkspaceUpload.state == RECEIVING,
            WorkspaceUpload.received_bytes == offset,
        )
        .values(received_bytes=offset + length, updated_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    upload = get_upload(session, owner, upload_id)
    session.refresh(upload)
    if cast(CursorResult[Any], result).rowcount != 1:
        raise UploadStateError(upload_fields(upload, chunk_bytes))
    return upload


def set_state(session: Session, upload: WorkspaceUpload, target: str) -> bool:
    """Move a receiving upload to ``target`` (compare-and-set); False when it was not
    receiving any more (the reaper or another commit won)."""
    moved = session.execute(
        update(WorkspaceUpload)
        .where(WorkspaceUpload.id == upload.id, WorkspaceUpload.state == RECEIVING)
        .values(state=target, updated_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    session.refresh(upload)
    return cast(CursorResult[Any], moved).rowcount == 1


def record_file(session: Session, upload: WorkspaceUpload, location: str) -> WorkspaceFile:
    """Write the owner's file row for the committed ``upload``, its bytes at ``location``."""
    now = utcnow()
    row = WorkspaceFile(
        owner=upload.owner, sha256=upload.sha256, size_bytes=upload.size_bytes,
        store=upload.store, location=location, upload_id=upload.id, created_at=now,
        last_used_at=now,
    )  # fmt: skip
    session.add(row)
    session.flush()
    return row


def get_workspace(session: Session, owner: str, digest: str) -> Workspace:
    """The owner's workspace ``digest``.

    Raises:
        WorkspaceNotFoundError: none, or another owner's (404).
    """
    row = session.scalars(
        select(Workspace).where(Workspace.owner == owner, Workspace.digest == digest)
    ).one_or_none()
    if row is None:
        raise WorkspaceNotFoundError(f"workspace {digest} not found")
    return row


def use_workspaces(session: Session, owner: str, digests: Iterable[tuple[str, list[str]]]) -> None:
    """Check that ``owner`` has each workspace a job about to be stored names, and mark it
    used now (retention's clock). ``digests``: ``(digest, loc)`` pairs, ``loc`` the spec
    field that names it (``["body", "workspace"]``).

    Raises:
        SpecValidationError: (422) one error per digest the owner has no workspace of
            (another owner's counts as none: nothing tells that it exists).
    """
    errors: list[dict[str, Any]] = []
    now = utcnow()
    for digest, loc in digests:
        row = session.scalars(
            select(Workspace).where(Workspace.owner == owner, Workspace.digest == digest)
        ).one_or_none()
        if row is None:
            errors.append({"loc": loc, "type": "value_error", "msg": (
                f"no workspace {digest[:12]}… of yours: upload it first (`ddpq run` and "
                "DdpqClient.run do)")})  # fmt: skip
        else:
            row.last_used_at = now
    if errors:
        raise SpecValidationError(errors)


class WorkspaceDamagedError(DdpqError):
    """A stored manifest that is no longer a valid one (its row was edited or damaged): 410,
    as a damaged checkpoint, so that a rank gives up at once instead of retrying a 500."""

    status_code = 410
    code = "workspace_damaged"


def manifest_of(row: Workspace) -> Manifest:
    """A stored workspace's manifest (validated when it was stored, and again now: a rank
    lays it out on disk).

    Raises:
        WorkspaceDamagedError: the stored row is not a valid manifest any more (410).
    """
    try:
        return Manifest.model_validate(row.manifest)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        raise WorkspaceDamagedError(
            f"the stored manifest of workspace {row.digest[:12]}… is damaged "
            f"({'.'.join(map(str, first['loc']))}: {first['msg']}); upload the workspace "
            "again (`ddpq run` does) and resubmit"
        ) from None


def missing_file_errors(manifest: Manifest, present: dict[str, int]) -> list[dict[str, Any]]:
    """One ``{loc, msg, type}`` per file of ``manifest`` whose content is not in ``present``
    (sha256 → size in bytes of the owner's committed files), or whose declared size is not
    the uploaded file's: a size that lies would slip past ``DDPQ_WORKSPACE_MAX_BYTES`` and
    fail every rank's check. The first ``MISSING_LISTED``, then one line counting the rest."""
    errors: list[dict[str, Any]] = []
    absent = [(i, f) for i, f in enumerate(manifest.files) if f.sha256 not in present]
    wrong = [
        (i, f)
        for i, f in enumerate(manifest.files)
        if f.sha256 in present and present[f.sha256] != f.size_bytes
    ]
    for i, f in wrong[:MISSING_LISTED]:
        errors.append({
            "loc": ["body", "manifest", "files", i, "size_bytes"],
            "msg": f"file {f.path!r} is declared {f.size_bytes} bytes, but the uploaded file "
            f"with sha256 {f.sha256} is {present[f.sha256]} bytes: declare its real size",
            "type": "size_mismatch",
        })  # fmt: skip
    for i, f in absent[: max(0, MISSING_LISTED - len(errors))]:
        errors.append({
            "loc": ["body", "manifest", "files", i, "sha256"],
            "msg": f"file {f.path!r} (sha256 {f.sha256}, {f.size_bytes} bytes) was not "
            "uploaded: upload it (POST /workspaces/files) before storing the manifest",
            "type": "file_not_uploaded",
        })  # fmt: skip
    unlisted = len(absent) + len(wrong) - len(errors)
    if unlisted > 0:
        errors.append({
            "loc": ["body", "manifest", "files"],
            "msg": f"and {unlisted} more files not uploaded or of the wrong size",
            "type": "file_not_uploaded",
        })  # fmt: skip
    return errors
