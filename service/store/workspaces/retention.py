"""Workspace retention, within a caller's session: which workspaces, files and uploads go.

A workspace goes once its ``last_used_at`` is older than the cutoff and no unfinished job
names it (``jobs.spec["workspace"]``, for the job's owner); a file goes once its own
``last_used_at`` is older than the cutoff and none of its owner's remaining workspaces names
it (the age keeps a file uploaded for a manifest not stored yet); an upload goes once
abandoned (the loser of two uploads of one content included, ``upload_service``), or
receiving without a chunk since the stale cutoff. Every query here is on an index of the age
or state it asks about: the reaper runs this every few seconds. The rows go in the caller's
transaction; the bytes are returned, for the caller to drop from the stores after it
committed (a rolled-back pass leaves no row without its bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from service.core.states import TERMINAL_STATES
from service.store.checkpoints.values import PendingDiscard
from service.store.models import Job, Workspace, WorkspaceFile, WorkspaceUpload
from service.store.workspaces.crud import ABANDONED, RECEIVING
from service.store.workspaces.stores import upload_key

# Rows of each kind one pass looks at (the reaper runs again soon).
PASS_LIMIT = 500


@dataclass
class Expired:
    """What one pass let go: counts, the committed files' ``(store, location)`` and the
    partial uploads to drop."""

    workspaces: int = 0
    files: list[tuple[str, str]] = field(default_factory=list)
    discards: list[PendingDiscard] = field(default_factory=list)


def workspaces_in_use(session: Session) -> set[tuple[str, str]]:
    """``(owner, digest)`` of every workspace an unfinished job names."""
    terminal = [s.value for s in TERMINAL_STATES]
    named = Job.spec["workspace"].as_string()
    rows = session.execute(
        select(Job.owner, named).where(Job.state.not_in(terminal), named.is_not(None))
    )
    return {(owner, digest) for owner, digest in rows if digest}


def expire_workspaces(
    session: Session, *, cutoff: datetime, stale_cutoff: datetime, limit: int = PASS_LIMIT
) -> Expired:
    """Delete the rows retention lets go (see the module docstring); what to drop after."""
    out = Expired()
    old = session.scalars(
        select(Workspace).where(Workspace.last_used_at < cutoff).order_by(Workspace.id).limit(limit)
    ).all()
    in_use = workspaces_in_use(session) if old else set()
    for ws in old:
        if (ws.owner, ws.digest) not in in_use:
            session.delete(ws)
            out.workspaces += 1
    session.flush()
    owners = session.scalars(
        select(WorkspaceFile.owner).where(WorkspaceFile.last_used_at < cutoff).distinct()
    ).all()
    gone_uploads: list[int] = []
    for owner in owners:
        kept: set[str] = set()
        for manifest in session.scalars(select(Workspace.manifest).where(Workspace.owner == owner)):
            kept.update(f["sha256"] for f in manifest["files"])
        stale = session.scalars(
            select(WorkspaceFile)
            .where(WorkspaceFile.owner == owner, WorkspaceFile.last_used_at < cutoff)
            .limit(limit)
        ).all()
        for f in stale:
            if f.sha256 not in kept:
                out.files.append((f.store, f.location))
                gone_uploads.append(f.upload_id)
                session.delete(f)
    session.flush()
    if gone_uploads:  # their chunk rows go with them (ON DELETE CASCADE)
        session.execute(delete(WorkspaceUpload).where(WorkspaceUpload.id.in_(gone_uploads)))
    session.execute(
        update(WorkspaceUpload)
        .where(WorkspaceUpload.state == RECEIVING, WorkspaceUpload.updated_at < stale_cutoff)
        .values(state=ABANDONED)
        .execution_options(synchronize_session=False)
    )
    abandoned = session.scalars(
        select(WorkspaceUpload).where(WorkspaceUpload.state == ABANDONED).limit(limit)
    ).all()
    for upload in abandoned:
        out.discards.append(PendingDiscard(upload.store, upload_key(upload.id)))
        session.delete(upload)
    session.flush()
    return out
