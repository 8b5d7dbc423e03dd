"""The attempt API's checkpoint records: the job's committed checkpoints (for resume), a
checkpoint rank 0 wrote into the API's own artifact directory (a rank sharing its
filesystem; others upload, ``uploads``), failed saves, and deletions.

Who may call it: only a holder of an attempt token, for its own job, while its attempt is the
job's current, active one (else 409 ``attempt superseded``); a user or API token is 401
(``deps.get_attempt``). No route takes a job id: the token names the job.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request, Response

from service.api.attempts.routes import ERRORS, _body_doc, _db, _json_body
from service.api.deps import REQUIRE_ATTEMPT, AttemptDep
from service.api.files import checkpoint_stores
from service.core.owners.quotas import QuotaLimits
from service.core.wire import attempt as wire
from service.store.checkpoints import service as checkpoints
from service.store.checkpoints.values import CheckpointInfo

router = APIRouter(tags=["attempts"], dependencies=[REQUIRE_ATTEMPT], responses=ERRORS)


def checkpoint_entry(info: CheckpointInfo) -> wire.CheckpointEntry:
    """A checkpoint as the attempt API shows it (``path`` as stored)."""
    return wire.CheckpointEntry(
        step=info.step,
        epoch=info.epoch,
        attempt=info.attempt,
        path=info.path,
        size_bytes=info.size_bytes,
        sha256=info.sha256,
        file_name=info.file_name,
    )


# -- routes -----------------------------------------------------------------------------------


@router.get(wire.CHECKPOINTS_PATH, response_model=wire.CheckpointList, summary="Checkpoints")
def checkpoints_route(request: Request, ref: AttemptDep) -> wire.CheckpointList:
    """The job's committed, not deleted checkpoints of every attempt, newest step first,
    paths as stored (for resume).

    Caller: a rank holding the attempt token (nobody else); 409 ``attempt superseded`` once
    the attempt is not current.
    """
    found = checkpoints.list_attempt_checkpoints(_db(request), ref)
    return wire.CheckpointList(checkpoints=[checkpoint_entry(c) for c in found])


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
    ``path`` must resolve inside this job's artifact directory; ``file_name`` (a followed
    checkpoint's workspace file) is kept with the row. The server reads the file first: one
    it cannot verify (missing, another size or sha256, no shared filesystem store) is
    refused and noted as a failed save in the job's events.

    Caller: a rank holding the attempt token (nobody else). Raises 409 ``attempt
    superseded`` when the attempt is not current (nothing recorded), 422 for a file the
    server cannot verify or a path elsewhere, 413 when the job's or owner's checkpoint
    quota has no room for it (a failed save and a ``quota_exceeded`` event).
    """
    settings = request.app.state.settings
    info = checkpoints.record_shared(
        _db(request),
        checkpoint_stores(request.app),
        ref,
        step=record.step,
        epoch=record.epoch,
        path=record.path,
        staged_path=record.staged_path,
        size_bytes=record.size_bytes,
        sha256=record.sha256,
        artifact_root=settings.resolved_artifact_dir,
        store_kind=settings.checkpoint_store,
        file_name=record.file_name,
        limits=QuotaLimits.from_settings(settings),
    )
    return checkpoint_entry(info)


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
    checkpoints.note_failed_save(_db(request), ref, step=failure.step, reason=failure.reason)
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
    checkpoints.delete_rank_checkpoints(
        _db(request),
        checkpoint_stores(request.app),
        ref,
        deletion.steps,
        damaged=deletion.damaged,
    )
    return Response(status_code=204)
