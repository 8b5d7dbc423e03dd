"""Checkpoint use cases: one function per operation, each owning its transaction and
returning plain values (``values``), never ORM rows.

Every write of a checkpoint row goes through ``_record``: the row and retention in one
transaction (``retention.record_and_retain``), then the files it let go are deleted from
their stores (``stores.delete_files``), only once that transaction committed. The attempt
API's operations run behind the attempt fence, checked inside their own transaction
(``attempts.fence.superseded_on_fence``: a superseded attempt is refused with 409
``attempt superseded: …``).

An upload's bytes come in through ``upload_service`` (begin, status, chunks); its commit,
which writes the checkpoint's row, is ``commit_upload`` here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sqlalchemy.orm import Session

from service.core.artifacts import artifact_relative_path
from service.core.errors import NotFoundError
from service.core.owners.quotas import QuotaExceededError, QuotaLimits
from service.store import quotas
from service.store.attempts.fence import superseded_on_fence
from service.store.attempts.tokens import current_state
from service.store.attempts.values import AttemptRef
from service.store.checkpoints import crud, events, retention, uploads
from service.store.checkpoints.backends.base import CheckpointStore, CheckpointStoreError
from service.store.checkpoints.checks import (
    CheckpointInputError,
    own_checkpoint_path,
    shared_record_problem,
    storable_text,
)
from service.store.checkpoints.chunks import UploadHashes
from service.store.checkpoints.init_from import init_from_checkpoint
from service.store.checkpoints.stores import CheckpointStores, delete_files, verify_stored
from service.store.checkpoints.values import (
    CheckpointInfo,
    DoomedFile,
    StoredFile,
    UploadCommitted,
)
from service.store.db import Database
from service.store.jobs.crud import get_job
from service.store.models import Checkpoint, CheckpointUpload
from service.store.workers.leases import check_attempt


def checkpoint_info(ckpt: Checkpoint) -> CheckpointInfo:
    """A checkpoints row as a value (read inside its session)."""
    return CheckpointInfo(
        step=ckpt.step,
        epoch=ckpt.epoch,
        attempt=ckpt.attempt,
        path=ckpt.path,
        size_bytes=ckpt.size_bytes,
        sha256=ckpt.sha256,
        store=ckpt.store,
        created_at=ckpt.created_at,
        file_name=ckpt.file_name,
    )


def stored_file(ckpt: Checkpoint) -> StoredFile:
    """Where a checkpoints row's bytes are: its store, location, size and sha256."""
    return StoredFile(ckpt.store, ckpt.location or ckpt.path, ckpt.size_bytes, ckpt.sha256)


def _record(
    db: Database,
    stores: CheckpointStores,
    write: Callable[[Session], tuple[Checkpoint, list[DoomedFile]]],
) -> CheckpointInfo:
    """Run ``write`` (a row written and retention applied) in one fenced transaction, then
    delete the files it let go: the one home of record → retention → delete."""
    with superseded_on_fence(), db.session() as session:
        ckpt, doomed = write(session)
        info = checkpoint_info(ckpt)
    delete_files(stores, doomed)
    return info


# -- a user's view (owner or admin) -----------------------------------------------------------


def list_job_checkpoints(db: Database, job_id: int, *, owner: str | None) -> list[CheckpointInfo]:
    """The job's committed, live checkpoints, newest step first.

    Raises:
        NotFoundError: no job ``job_id`` of ``owner`` (None: any owner).
    """
    with db.session(write=False) as session:
        get_job(session, job_id, owner=owner)
        return [checkpoint_info(c) for c in crud.list_checkpoints(session, job_id)]


def open_job_checkpoint(
    db: Database, stores: CheckpointStores, job_id: int, step: int, *, owner: str | None
) -> StoredFile:
    """The job's live checkpoint at ``step``, verified in its store (ready to stream).

    Raises:
        NotFoundError: no such job of ``owner``, no live checkpoint at ``step``, or its file
            is gone (404).
        StoredFileDamagedError: the store holds another size than recorded (410).
    """
    with db.session(write=False) as session:
        get_job(session, job_id, owner=owner)
        stored = stored_file(crud.get_checkpoint(session, job_id, step))
    verify_stored(stores, stored)
    return stored


# -- the attempt API (rank 0 of the token's attempt) ------------------------------------------


def list_attempt_checkpoints(db: Database, ref: AttemptRef) -> list[CheckpointInfo]:
    """The job's committed, live checkpoints of every attempt, newest step first (resume).

    Raises:
        StaleAttemptError: ``ref`` is not the job's current, active attempt (409).
    """
    with superseded_on_fence(), db.session(write=False) as session:
        current_state(session, ref)
        return [checkpoint_info(c) for c in crud.list_checkpoints(session, ref.job_id)]


def note_failed_save(db: Database, ref: AttemptRef, *, step: int, reason: str) -> None:
    """A job event for a checkpoint at ``step`` that could not be written (``reason`` as the
    rank tells it; NUL and lone surrogates replaced).

    Raises:
        StaleAttemptError: the attempt is superseded (409, nothing noted).
    """
    with superseded_on_fence(), db.session() as session:
        crud.record_checkpoint_failure(
            session, ref.job_id, ref.attempt, step=step, reason=storable_text(reason)
        )


def record_shared(
    db: Database,
    stores: CheckpointStores,
    ref: AttemptRef,
    *,
    step: int,
    epoch: int,
    path: str,
    staged_path: str | None,
    size_bytes: int,
    sha256: str,
    artifact_root: Path,
    store_kind: str,
    file_name: str | None = None,
    limits: QuotaLimits | None = None,
) -> CheckpointInfo:
    """Record a checkpoint file rank 0 wrote into the API's own artifact directory (a rank
    sharing this filesystem), once the server verified it; then apply retention and delete
    what it let go. A re-record of ``step`` replaces it.

    Args:
        path: where the file lies (``staged_path``: where it lies until the rank renames it
            to ``path``, or None); absolute, or relative to ``artifact_root``.
        size_bytes, sha256: what the rank says the file holds (bytes, lowercase hex).
        artifact_root: the API's resolved artifact directory.
        store_kind: ``Settings.checkpoint_store``; only ``filesystem`` accepts a record.
        file_name: the workspace file a followed checkpoint is a version of (checked by the
            wire model); None for ddpq's own.
        limits: the job's and owner's checkpoint quotas the file must fit (it replaces
            the checkpoint at ``step``, if any).
    Raises:
        QuotaExceededError: no room in a checkpoint quota (413; a failed save, with a
            ``checkpoint_failed`` and a ``quota_exceeded`` event).
        CheckpointInputError: the file cannot be verified (422; the job got a "checkpoint at
            step N not written: …" event first), or ``path`` lies outside the job's
            artifact directory (422).
        StaleAttemptError: the attempt is superseded (409, nothing recorded or noted).
    """
    problem = shared_record_problem(
        artifact_root,
        store_kind,
        ref.job_id,
        path=path,
        staged_path=staged_path,
        size_bytes=size_bytes,
        sha256=sha256,
    )  # blocking: it hashes the file, before any transaction
    if problem is not None:
        # A file name may carry a lone surrogate or NUL, which neither database stores.
        problem = storable_text(problem)
        with superseded_on_fence(), db.session() as session:
            crud.record_checkpoint_failure(
                session, ref.job_id, ref.attempt, step=step, reason=problem
            )
        raise CheckpointInputError(problem)
    path = own_checkpoint_path(artifact_root, ref.job_id, path)
    location = artifact_relative_path(artifact_root, path) or path

    def write(session: Session) -> tuple[Checkpoint, list[DoomedFile]]:
        if limits is not None:
            job = check_attempt(session, ref.job_id, ref.attempt)
            replaced = [c.size_bytes for c in crud.list_checkpoints(session, ref.job_id)
                        if c.step == step]  # fmt: skip
            quotas.check_checkpoint_room(
                session, ref.job_id, job.owner, adding=size_bytes, freed=sum(replaced),
                limits=limits, begins_upload=False,
            )  # fmt: skip
        return retention.record_and_retain(
            session,
            ref.job_id,
            ref.attempt,
            step=step,
            epoch=epoch,
            path=path,
            size_bytes=size_bytes,
            sha256=sha256,
            store="filesystem",
            location=location,
            file_name=file_name,
        )

    try:
        return _record(db, stores, write)
    except QuotaExceededError as exc:
        with superseded_on_fence(), db.session() as session:
            check_attempt(session, ref.job_id, ref.attempt)
            crud.record_checkpoint_failure(session, ref.job_id, ref.attempt, step=step,
                                           reason=exc.hit.words())  # fmt: skip
            quotas.record_quota_hit(session, ref.job_id, ref.attempt, exc.hit)
        raise


def delete_rank_checkpoints(
    db: Database, stores: CheckpointStores, ref: AttemptRef, steps: list[int], *, damaged: bool
) -> None:
    """Mark the job's live checkpoints at ``steps`` deleted (rank 0 rotated them away or found
    them damaged, ``damaged``), one event each, then remove their bytes from the stores. A
    step another job's ``init_from`` pins is kept; a step without a checkpoint is ignored.

    Raises:
        StaleAttemptError: the attempt is superseded (409, nothing marked): a superseded
            attempt must not rotate away what the current one relies on.
    """
    with superseded_on_fence(), db.session() as session:
        job = check_attempt(session, ref.job_id, ref.attempt)  # row-locked: a requeue waits
        kept = set(steps) - retention.pinned_steps(session, ref.job_id)
        marked = crud.mark_checkpoints_deleted(session, ref.job_id, sorted(kept))
        events.note_rank_deletions(session, job, ref.attempt, [m[0] for m in marked],
                                   damaged=damaged)  # fmt: skip
    delete_files(stores, [DoomedFile(ref.job_id, s, store, loc) for s, store, loc in marked])


def open_resume_checkpoint(
    db: Database, stores: CheckpointStores, ref: AttemptRef, step: int
) -> StoredFile:
    """The job's live checkpoint at ``step``, verified in its store, now the attempt's resume
    point (retention keeps it until the attempt commits a newer one).

    Raises:
        StaleAttemptError: the attempt is superseded (409).
        NotFoundError: no live checkpoint at ``step``, or its file is gone (404).
        StoredFileDamagedError: the store holds another size than recorded (410).
    """
    with db.session() as session:
        with superseded_on_fence():
            check_attempt(session, ref.job_id, ref.attempt)
        stored = stored_file(crud.mark_resumed(session, ref.job_id, ref.attempt, step))
    verify_stored(stores, stored)
    return stored


def open_init_from_checkpoint(
    db: Database, stores: CheckpointStores, ref: AttemptRef
) -> StoredFile:
    """The source checkpoint of the job's ``init_from`` (resolved at submit, where the owner
    was checked), verified in its store.

    Raises:
        StaleAttemptError: the attempt is superseded (409).
        NotFoundError: the job has no ``init_from``, or its checkpoint or file is gone (404).
        StoredFileDamagedError: the store holds another size than recorded (410).
    """
    with db.session(write=False) as session:
        with superseded_on_fence():
            current_state(session, ref)
        found = init_from_checkpoint(session, ref.job_id)
        if found is None:
            raise NotFoundError("this job has no init_from")
        job, ckpt = found
        if ckpt is None or ckpt.deleted_at is not None:
            raise NotFoundError(
                f"job {job.init_from_job_id}'s checkpoint at step {job.init_from_step} is gone"
            )
        stored = stored_file(ckpt)
    verify_stored(stores, stored)
    return stored


def record_rank_note(
    db: Database, ref: AttemptRef, kind: str, *, step: int | None, total_steps: int | None
) -> None:
    """Write a decision of rank 0's (``AttemptNote.kind``) as a job event, worded by the
    server; once per attempt and text.

    Raises:
        StaleAttemptError: the attempt is superseded (409, nothing written).
    """
    with superseded_on_fence(), db.session() as session:
        events.record_note(session, ref.job_id, ref.attempt, kind, step=step,
                           total_steps=total_steps)  # fmt: skip


# -- uploads (rank 0 of the token's attempt) --------------------------------------------------


def _whole_sha256(store: CheckpointStore, hashes: UploadHashes, upload: CheckpointUpload) -> str:
    """The sha256 of the upload's bytes as ``store`` holds them: hashed as the chunks arrived
    when this process took them all (and the store still holds that many), else read back.

    Raises:
        CheckpointStoreError: the store cannot read the bytes back (503).
    """
    key = uploads.upload_key(upload)
    sha256 = hashes.whole(upload.id, upload.size_bytes)
    if sha256 is not None and store.received_size(key) != upload.size_bytes:
        sha256 = None  # the store lost bytes since: check what it holds now
    if sha256 is None:
        try:
            sha256 = store.partial_sha256(key)
        except OSError as exc:
            raise CheckpointStoreError(f"cannot read upload {upload.id} back: {exc}") from None
    hashes.forget(upload.id)
    return sha256


def commit_upload(
    db: Database,
    stores: CheckpointStores,
    hashes: UploadHashes,
    ref: AttemptRef,
    upload_id: int,
    *,
    chunk_bytes: int,
) -> UploadCommitted:
    """Verify the whole uploaded file's sha256 as its store holds it, finalize it there, then
    commit the upload and write the checkpoint's row in one transaction with retention, and
    delete what retention let go. A repeated commit returns the same checkpoint
    (``created`` False).

    Raises:
        StaleAttemptError: the attempt is superseded (409).
        UploadNotFoundError: no such upload of this job (404).
        UploadStateError: bytes are missing or the upload is not receiving (409).
        CheckpointInputError: the file's sha256 does not match (422): the upload is
            abandoned with a job event, its bytes dropped; begin it again.
        CheckpointStoreError: the store cannot read or finalize the bytes (503).
    """
    with db.session(write=False) as session:
        with superseded_on_fence():
            current_state(session, ref)
        upload = uploads.get_upload(session, ref.job_id, upload_id)
        if upload.state == uploads.COMMITTED:
            ckpt = crud.get_checkpoint(session, ref.job_id, upload.step)
            return UploadCommitted(checkpoint_info(ckpt), created=False)
        uploads.check_chunk_offset(upload, ref.attempt, upload.size_bytes, chunk_bytes)
    store = stores[upload.store]
    key = uploads.upload_key(upload)
    sha256 = _whole_sha256(store, hashes, upload)
    if sha256 != upload.sha256:
        with superseded_on_fence(), db.session() as session:
            uploads.abandon_upload(
                session,
                ref.job_id,
                ref.attempt,
                upload_id,
                reason=f"the uploaded file's sha256 {sha256} is not {upload.sha256} "
                "(corrupted on the way): upload discarded",
            )
        store.discard(key)
        raise CheckpointInputError(
            f"upload {upload_id}: the file's sha256 is {sha256}, not {upload.sha256}; "
            "the upload is discarded: begin it again"
        )
    location = store.finalize(key)

    def write(session: Session) -> tuple[Checkpoint, list[DoomedFile]]:
        return uploads.commit_upload(session, ref.job_id, ref.attempt, upload_id, location=location)

    return UploadCommitted(_record(db, stores, write), created=True)
