"""Workspace use cases: which files an owner lacks, store a manifest, read one back (by the
owner, or for a job's ranks), and retention. Each opens its own session and returns plain
values or the wire's ``Manifest``; the file uploads are ``upload_service``.

Everything is per owner: another owner's workspace is "not found" exactly as a missing one,
and another owner's file counts as missing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta

from sqlalchemy import select, update

from service.core.errors import ConflictError, JobNotFoundError, NotFoundError
from service.core.wire.workspace import FileRef, Manifest
from service.store.attempts.fence import superseded_on_fence
from service.store.attempts.tokens import current_state
from service.store.attempts.values import AttemptRef
from service.store.checkpoints.stores import CheckpointStores
from service.store.checkpoints.values import StoredFile
from service.store.db import Database
from service.store.models import Job, Workspace, utcnow
from service.store.workspaces import crud, retention
from service.store.workspaces.crud import WorkspaceNotFoundError as WorkspaceNotFoundError
from service.store.workspaces.values import WorkspacesReaped, WorkspaceStored

log = logging.getLogger(__name__)

# How stale a file's ``last_used_at`` may get before a missing-files check moves it: the
# check then guards the file until the manifest that names it is stored, at one write a day.
TOUCH_AFTER = timedelta(days=1)


def missing_files(db: Database, owner: str, files: Sequence[FileRef]) -> list[str]:
    """The sha256 of each of ``files`` the owner has no committed file of, in the order
    asked, each once. The files the owner has are kept from retention a while longer."""
    with db.session() as session:
        present = crud.present_sha256s(session, owner, (f.sha256 for f in files))
        now = utcnow()
        crud.touch_files(session, owner, present, now, older_than=now - TOUCH_AFTER)
    return list(dict.fromkeys(f.sha256 for f in files if f.sha256 not in present))


def create_workspace(
    db: Database, owner: str, manifest: Manifest, *, max_bytes: int, max_files: int
) -> WorkspaceStored:
    """Store the owner's ``manifest`` under its digest (``created`` False when the owner had
    it already: its ``last_used_at`` moves on).

    Raises:
        WorkspaceTooLargeError: over ``max_bytes`` in total or ``max_files`` files (413).
        WorkspaceFilesMissingError: files the owner has not uploaded, one error per file
            (422).
    """
    manifest.check_limits(max_bytes=max_bytes, max_files=max_files)
    try:
        return _store_manifest(db, owner, manifest)
    except ConflictError:  # the same digest stored at once by another request: it won
        return _store_manifest(db, owner, manifest)


def _store_manifest(db: Database, owner: str, manifest: Manifest) -> WorkspaceStored:
    digest = manifest.digest()
    shas = [f.sha256 for f in manifest.files]
    with db.session() as session:
        now = utcnow()
        held = session.scalars(
            select(Workspace).where(Workspace.owner == owner, Workspace.digest == digest)
        ).one_or_none()
        if held is not None:
            held.last_used_at = now
            crud.touch_files(session, owner, shas, now)
            return WorkspaceStored(digest, held.file_count, held.total_bytes, created=False)
        present = crud.present_sha256s(session, owner, shas)
        errors = crud.missing_file_errors(manifest, present)
        if errors:
            raise crud.WorkspaceFilesMissingError(errors)
        session.add(
            Workspace(
                owner=owner, digest=digest, manifest=manifest.model_dump(mode="json"),
                file_count=manifest.file_count, total_bytes=manifest.total_bytes,
                created_at=now, last_used_at=now,
            )
        )  # fmt: skip
        crud.touch_files(session, owner, shas, now)
    return WorkspaceStored(digest, manifest.file_count, manifest.total_bytes, created=True)


def get_manifest(db: Database, owner: str, digest: str) -> Manifest:
    """The manifest of the owner's workspace ``digest``.

    Raises:
        WorkspaceNotFoundError: no such workspace of this owner; another owner's answers
            exactly alike (404, code ``workspace_not_found``).
    """
    with db.session(write=False) as session:
        return crud.manifest_of(crud.get_workspace(session, owner, digest))


def job_manifest(db: Database, job_id: int) -> Manifest:
    """The manifest of the workspace job ``job_id``'s spec names (``spec["workspace"]``, a
    digest), looked up for the job's owner.

    Raises:
        JobNotFoundError: no such job (404).
        WorkspaceNotFoundError: the spec names no workspace, or one its owner does not have
            (404, code ``workspace_not_found``).
    """
    with db.session(write=False) as session:
        row = session.execute(select(Job.owner, Job.spec).where(Job.id == job_id)).one_or_none()
        if row is None:
            raise JobNotFoundError(job_id)
        owner, spec = row
        digest = spec.get("workspace") if isinstance(spec, dict) else None
        if not isinstance(digest, str) or not digest:
            raise WorkspaceNotFoundError(f"job {job_id} names no workspace")
        return crud.manifest_of(crud.get_workspace(session, owner, digest))


def _attempt_workspace(db: Database, ref: AttemptRef) -> tuple[str, Manifest]:
    """The owner and manifest of the attempt's job's workspace, after the fence; its
    ``last_used_at`` moves on (a rank using it keeps it from retention)."""
    with db.session() as session:
        with superseded_on_fence():
            current_state(session, ref)
        owner, spec = session.execute(select(Job.owner, Job.spec).where(Job.id == ref.job_id)).one()
        digest = spec.get("workspace") if isinstance(spec, dict) else None
        if not isinstance(digest, str) or not digest:
            raise WorkspaceNotFoundError(f"job {ref.job_id} names no workspace")
        row = crud.get_workspace(session, owner, digest)
        session.execute(
            update(Workspace)
            .where(Workspace.id == row.id)
            .values(last_used_at=utcnow())
            .execution_options(synchronize_session=False)
        )
        return owner, crud.manifest_of(row)


def attempt_manifest(db: Database, ref: AttemptRef) -> Manifest:
    """The manifest of the workspace the attempt's job names.

    Raises:
        StaleAttemptError: the attempt is superseded (409).
        WorkspaceNotFoundError: the job names no workspace, or it is gone (404).
    """
    return _attempt_workspace(db, ref)[1]


def open_attempt_file(
    db: Database, stores: CheckpointStores, ref: AttemptRef, sha256: str
) -> StoredFile:
    """The file with ``sha256`` of the attempt's job's workspace, checked present whole in
    its store, to stream.

    Raises:
        StaleAttemptError: the attempt is superseded (409).
        WorkspaceNotFoundError: the job names no workspace, or it is gone (404).
        NotFoundError: the workspace has no file with this sha256, or its bytes are gone
            or not whole (404).
    """
    owner, manifest = _attempt_workspace(db, ref)
    if not any(f.sha256 == sha256 for f in manifest.files):
        raise NotFoundError(f"the job's workspace has no file with sha256 {sha256}")
    with db.session(write=False) as session:
        row = crud.find_file(session, owner, sha256)
        if row is None:
            raise NotFoundError(f"workspace file {sha256} not found")
        stored = StoredFile(row.store, row.location, row.size_bytes, row.sha256)
    store = stores.get(stored.store)
    held = None if store is None else store.size(stored.location)
    # The database store holds no row for an empty file: nothing to check, nothing to read.
    if stored.size_bytes and held != stored.size_bytes:
        raise NotFoundError(f"workspace file {sha256}: its bytes are gone or damaged")
    return stored


def reap_workspaces(
    db: Database, stores: CheckpointStores, *, retention_days: float, upload_stale_s: float
) -> WorkspacesReaped:
    """One retention pass (``retention``): delete the workspaces no unfinished job names
    that went unused for ``retention_days`` days, then the files none of their owner's
    workspaces names any more (unused as long), and abandoned uploads or those without a
    chunk for ``upload_stale_s`` seconds; their bytes go from the stores after the commit
    (a failure there is logged, never raised: no row names those bytes any more)."""
    now = utcnow()
    with db.session() as session:
        expired = retention.expire_workspaces(
            session,
            cutoff=now - timedelta(days=retention_days),
            stale_cutoff=now - timedelta(seconds=upload_stale_s),
        )
    for store_name, location in expired.files:
        store = stores.get(store_name)
        try:
            if store is not None:
                store.delete(location)
        except Exception:
            log.exception("could not delete workspace file %s from %s", location, store_name)
    for d in expired.discards:
        store = stores.get(d.store)
        if store is not None:
            store.discard(d.key)
    return WorkspacesReaped(expired.workspaces, len(expired.files), len(expired.discards))
