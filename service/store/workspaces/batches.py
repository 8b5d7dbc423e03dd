"""The rows of a batch of small workspace files (``service.core.wire.batch``), within a
caller's session: an upload row per new file reserved before its bytes are stored (its id
names them in the store), then all of them committed with their ``workspace_files`` rows in
one transaction. A file's rows are the per-file protocol's (an upload ``committed``, whole),
so the rest of the store (retention, ranks' reads, ``missing``) cannot tell them apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import CursorResult, insert, update
from sqlalchemy.orm import Session

from service.core.errors import ConflictError
from service.core.wire.workspace import FileRef
from service.store.models import WorkspaceFile, WorkspaceUpload, utcnow
from service.store.workspaces.crud import ABANDONED, COMMITTED, RECEIVING, present_sha256s


def reserve_uploads(session: Session, owner: str, refs: Sequence[FileRef], store: str) -> list[int]:
    """One ``receiving`` upload row per file of ``refs`` for ``owner`` in ``store``: their
    ids, in the order of ``refs`` (the keys their bytes go under). One bulk INSERT …
    RETURNING, no ORM object per row (those cost more than the insert for 1,000 files).
    A row left receiving (the API stopped before the commit) is reaped as a stale upload."""
    if not refs:
        return []
    now = utcnow()
    values = [
        {
            "owner": owner, "sha256": ref.sha256, "size_bytes": ref.size_bytes,
            "received_bytes": 0, "state": RECEIVING, "store": store, "created_at": now,
            "updated_at": now,
        }
        for ref in refs
    ]  # fmt: skip
    returning = insert(WorkspaceUpload).returning(WorkspaceUpload.id, sort_by_parameter_order=True)
    return [int(upload_id) for upload_id in session.scalars(returning, values)]


def commit_uploads(
    session: Session, owner: str, store: str, uploads: Sequence[tuple[int, FileRef, str]]
) -> list[int]:
    """Commit the reserved uploads ``(upload_id, ref, location)`` whose bytes are stored in
    ``store``: each
    ``committed`` with its owner's file row, in the caller's one transaction. A file the owner
    got meanwhile (another request committed it first) keeps that one: this upload is
    ``abandoned`` instead.

    Returns:
        The ids of the abandoned uploads (the caller discards their bytes after the commit).
    Raises:
        ConflictError: an upload was not receiving any more (reaped meanwhile: 409, send the
            batch again); or another request committed the same file at once (the unique
            constraint, translated by the session: try once more).
    """
    held = present_sha256s(session, owner, (ref.sha256 for _, ref, _ in uploads))
    kept = [u for u in uploads if u[1].sha256 not in held]
    dropped = [upload_id for upload_id, ref, _ in uploads if ref.sha256 in held]
    now = utcnow()
    for ids, target in (([u[0] for u in kept], COMMITTED), (dropped, ABANDONED)):
        if not ids:
            continue
        moved = session.execute(
            update(WorkspaceUpload)
            .where(WorkspaceUpload.id.in_(ids), WorkspaceUpload.state == RECEIVING)
            # received_bytes says "whole", as after an upload's last chunk.
            .values(state=target, received_bytes=WorkspaceUpload.size_bytes, updated_at=now)
            .execution_options(synchronize_session=False)
        )
        if cast(CursorResult[Any], moved).rowcount != len(ids):
            raise ConflictError(
                "some uploads of this batch were reaped before their commit: send it again"
            )
    if kept:  # one executemany: nothing to read back
        session.execute(
            insert(WorkspaceFile),
            [
                {
                    "owner": owner, "sha256": ref.sha256, "size_bytes": ref.size_bytes,
                    "store": store, "location": location, "upload_id": upload_id,
                    "created_at": now, "last_used_at": now,
                }
                for upload_id, ref, location in kept
            ],
        )  # fmt: skip
    return dropped


def abandon_uploads(session: Session, upload_ids: Sequence[int]) -> None:
    """Mark the reserved uploads ``upload_ids`` ``abandoned`` (their batch failed; the caller
    discards their bytes): those still receiving, none committed ever."""
    if upload_ids:
        session.execute(
            update(WorkspaceUpload)
            .where(WorkspaceUpload.id.in_(upload_ids), WorkspaceUpload.state == RECEIVING)
            .values(state=ABANDONED, updated_at=utcnow())
            .execution_options(synchronize_session=False)
        )
