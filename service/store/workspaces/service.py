"""Workspace use cases: which files an owner lacks, store a manifest, read one back (by the
owner, or for a job's ranks), and retention. Each opens its own session and returns plain
values or the wire's ``Manifest``; the file uploads are ``upload_service``.

Everything is per owner: another owner's workspace is "not found" exactly as a missing one,
and another owner's file counts as missing.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from datetime import timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

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


class _ListedFiles:
    """The sha256 set of each manifest by ``(owner, digest)``, the most recently used
    ``limit`` kept (thread-safe)."""

    def __init__(self, limit: int = 64) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._sets: OrderedDict[tuple[str, str], frozenset[str]] = OrderedDict()

    def get(self, owner: str, digest: str) -> frozenset[str] | None:
        with self._lock:
            found = self._sets.get((owner, digest))
            if found is not None:
                self._sets.move_to_end((owner, digest))
            return found

    def put(self, owner: str, digest: str, listed: frozenset[str]) -> frozenset[str]:
        with self._lock:
            self._sets[(owner, digest)] = listed
            while len(self._sets) > self._limit:
                self._sets.popitem(last=False)
        return listed


_LISTED = _ListedFiles()


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
        present = crud.present_sizes(session, owner, shas)
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


def _job_workspace(session: Session, ref: AttemptRef) -> tuple[str, str]:
    """The owner and digest of the workspace the attempt's job names, after the fence."""
    with superseded_on_fence():
        current_state(session, ref)
    owner, spec = session.execute(select(Job.owner, Job.spec).where(Job.id == ref.job_id)).one()
    digest = spec.get("workspace") if isinstance(spec, dict) else None
    if not isinstance(digest, str) or not digest:
        raise WorkspaceNotFoundError(f"job {ref.job_id} names no workspace")
    return owner, digest


def attempt_manifest(db: Database, ref: AttemptRef) -> Manifest:
    """The manifest of the workspace the attempt's job names; its ``last_used_at`` moves on
    (a rank using it keeps it from retention).

    Raises:
        StaleAttemptError: the attempt is superseded (409).
        WorkspaceNotFoundError: the job names no workspace, or it is gone (404).
    """
    with db.session() as session:
        owner, digest = _job_workspace(session, ref)
        row = crud.get_workspace(session, owner, digest)
        session.execute(
            update(Workspace)
            .where(Workspace.id == row.id)
            .values(last_used_at=utcnow())
            .execution_options(synchronize_session=False)
        )
        return crud.manifest_of(row)


def open_attempt_file(
    db: Database, stores: CheckpointStores, ref: AttemptRef, sha256: str
) -> StoredFile:
    """The file with ``sha256`` of the attempt's job's workspace, checked present whole in
    its store, to stream. Which files a manifest lists is remembered per process (a manifest
    never changes under its digest): a rank fetching thousands of files costs three small
    queries each, not a parse of the manifest each.

    Raises:
        StaleAttemptError: the attempt is superseded (409).
        WorkspaceNotFoundError: the job names no workspace, or it is gone (404).
        NotFoundError: the workspace has no file with this sha256, or its bytes are gone
            or not whole (404).
    """
    with db.session(write=False) as session:
        owner, digest = _job_workspace(session, ref)
        listed = _LISTED.get(owner, digest)
        if listed is None:
            row = crud.get_workspace(session, owner, digest)
            shas = frozenset(f["sha256"] for f in row.manifest["files"])
            listed = _LISTED.put(owner, digest, shas)
        if sha256 not in listed:
            raise NotFoundError(f"the job's workspace has no file with sha256 {sha256}")
        found = crud.find_file(session, owner, sha256)
        if found is None:
            raise NotFoundError(f"workspace file {sha256} not found")
        stored = StoredFile(found.store, found.location, found.size_bytes, found.sha256)
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
