"""The attempt API's checkpoint records: the job's committed checkpoints (for resume), a
checkpoint rank 0 wrote into the API's own artifact directory (a rank sharing its
filesystem; others upload, ``attempt_uploads``), failed saves, and deletions.

Who may call it: only a holder of an attempt token, for its own job, while its attempt is the
job's current, active one (else 409 ``attempt superseded``); a user or API token is 401
(``deps.get_attempt``). No route takes a job id: the token names the job.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Annotated

from fastapi import APIRouter, Request, Response

from service.api.attempts.records import refuse_unverified
from service.api.attempts.routes import (
    ERRORS,
    AttemptInputError,
    _body_doc,
    _db,
    _fenced,
    _json_body,
    _storable_text,
)
from service.api.deps import REQUIRE_ATTEMPT, AttemptDep
from service.api.files import checkpoint_stores
from service.core.artifacts import artifact_relative_path
from service.core.wire import attempt as wire
from service.store.attempts.tokens import current_state
from service.store.checkpoints.crud import (
    list_checkpoints,
    mark_checkpoints_deleted,
    record_checkpoint,
    record_checkpoint_failure,
)
from service.store.checkpoints.events import note_rank_deletions
from service.store.checkpoints.retention import (
    DoomedFile,
    apply_retention,
    delete_files,
    pinned_steps,
    replaced_files,
)
from service.store.workers.leases import check_attempt

router = APIRouter(tags=["attempts"], dependencies=[REQUIRE_ATTEMPT], responses=ERRORS)


def _own_checkpoint_path(root: Path, job_id: int, path: str) -> str:
    """``path`` as given, once it is known to resolve inside the job's own artifact directory
    (``jobs/<job_id>/``; symlinks followed), so a record can name no other job's file.

    Raises:
        AttemptInputError: it lies elsewhere, or cannot be stored (NUL, lone surrogates).
    """
    if _storable_text(path) != path:
        raise AttemptInputError("checkpoint path holds NUL or a lone surrogate")
    relative = artifact_relative_path(root, path)
    if relative is None or PurePosixPath(relative).parts[:2] != ("jobs", str(job_id)):
        raise AttemptInputError(
            f"checkpoint path must lie inside this job's artifact directory (jobs/{job_id}/ "
            "under the server's artifact root)"
        )
    return path


# -- routes -----------------------------------------------------------------------------------


@router.get(wire.CHECKPOINTS_PATH, response_model=wire.CheckpointList, summary="Checkpoints")
def checkpoints_route(request: Request, ref: AttemptDep) -> wire.CheckpointList:
    """The job's committed, not deleted checkpoints of every attempt, newest step first,
    paths as stored (for resume).

    Caller: a rank holding the attempt token (nobody else); 409 ``attempt superseded`` once
    the attempt is not current.
    """
    with _fenced(ref), _db(request).session(write=False) as session:
        current_state(session, ref)
        rows = list_checkpoints(session, ref.job_id)
        entries = [
            wire.CheckpointEntry(
                step=c.step,
                epoch=c.epoch,
                attempt=c.attempt,
                path=c.path,
                size_bytes=c.size_bytes,
                sha256=c.sha256,
            )
            for c in rows
        ]
    return wire.CheckpointList(checkpoints=entries)


@router.post(
    wire.CHECKPOINTS_PATH,
    status_code=201,
    response_model=wire.CheckpointEntry,
    summary="Record a checkpoint",
    openapi_extra=_body_doc(wire.CheckpointRecord),
)
def record_checkpoint_route(
    request: Request,
    ref: AttemptDep,
    record: Annotated[wire.CheckpointRecord, _json_body(wire.CheckpointRecord)],
) -> wire.CheckpointEntry:
    """Record a checkpoint file rank 0 wrote and verified into the API's own artifact
    directory (a rank that shares the API's filesystem; others upload), then apply
    retention (the server deletes what it lets go). A re-record of a step replaces it.
    ``path`` must resolve inside this job's artifact directory.

    Caller: a rank holding the attempt token (nobody else). Raises 409 ``attempt
    superseded`` when the attempt is not current (nothing recorded), 422 for a path
    elsewhere.
    """
    root = request.app.state.settings.resolved_artifact_dir
    refuse_unverified(request, ref, record)  # the file must really be there (422 + an event)
    path = _own_checkpoint_path(root, ref.job_id, record.path)
    location = artifact_relative_path(root, path) or path
    with _fenced(ref), _db(request).session() as session:
        check_attempt(session, ref.job_id, ref.attempt)
        # An uploaded file of the same step (its own name) is let go once this row replaces it.
        doomed = replaced_files(
            session, ref.job_id, record.step, store="filesystem", location=location
        )
        record_checkpoint(
            session,
            ref.job_id,
            ref.attempt,
            step=record.step,
            epoch=record.epoch,
            path=path,
            size_bytes=record.size_bytes,
            sha256=record.sha256,
            store="filesystem",
            location=location,
        )
        doomed += apply_retention(session, ref.job_id)
    delete_files(checkpoint_stores(request.app), doomed)
    entry = record.model_dump(exclude={"staged_path"}) | {"path": path}
    return wire.CheckpointEntry(attempt=ref.attempt, **entry)


@router.post(
    wire.CHECKPOINT_FAILURES_PATH,
    status_code=204,
    response_class=Response,
    summary="Note a failed checkpoint save",
    openapi_extra=_body_doc(wire.CheckpointFailure),
)
def checkpoint_failure_route(
    request: Request,
    ref: AttemptDep,
    failure: Annotated[wire.CheckpointFailure, _json_body(wire.CheckpointFailure)],
) -> Response:
    """Note a checkpoint that could not be written, as a job event ("checkpoint at step N
    not written: …").

    Caller: a rank holding the attempt token (nobody else); 409 ``attempt superseded`` when
    the attempt is not current (nothing noted).
    """
    reason = _storable_text(failure.reason)
    with _fenced(ref), _db(request).session() as session:
        record_checkpoint_failure(
            session, ref.job_id, ref.attempt, step=failure.step, reason=reason
        )
    return Response(status_code=204)


@router.post(
    wire.CHECKPOINT_DELETIONS_PATH,
    status_code=204,
    response_class=Response,
    summary="Mark checkpoints deleted",
    openapi_extra=_body_doc(wire.CheckpointDeletion),
)
def checkpoint_deletions_route(
    request: Request,
    ref: AttemptDep,
    deletion: Annotated[wire.CheckpointDeletion, _json_body(wire.CheckpointDeletion)],
) -> Response:
    """Mark this job's checkpoints at ``steps`` deleted (rotated away or found damaged);
    steps it has no checkpoint at are ignored.

    Their bytes are removed from the server's store too. A step another job's ``init_from``
    pins is kept. Retention is the server's (``checkpoint_retention``): a rank need not
    rotate through this route any more.

    Caller: a rank holding the attempt token (nobody else), for its own job only; 409
    ``attempt superseded`` when the attempt is not current (nothing marked): a superseded
    attempt must not rotate away what the current one relies on.
    """
    with _fenced(ref), _db(request).session() as session:
        job = check_attempt(session, ref.job_id, ref.attempt)  # row-locked: a requeue waits
        steps = set(deletion.steps) - pinned_steps(session, ref.job_id)
        marked = mark_checkpoints_deleted(session, ref.job_id, sorted(steps))
        note_rank_deletions(session, job, ref.attempt, [m[0] for m in marked],
                            damaged=deletion.damaged)  # fmt: skip
    doomed = [DoomedFile(ref.job_id, step, store, location) for step, store, location in marked]
    delete_files(checkpoint_stores(request.app), doomed)
    return Response(status_code=204)
