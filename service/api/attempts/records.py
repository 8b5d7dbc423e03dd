"""The shared-filesystem record's check (``POST /attempts/self/checkpoints``): before the row
is written, the server reads the file the rank names (``service.store.checkpoints.checks``);
a record it cannot verify is refused with 422 and noted as a failed save in the job's events,
so a refused record is never only a line in the rank's log.
"""

from __future__ import annotations

from fastapi import Request

from service.core.errors import DdpqError, NotFoundError, StaleAttemptError
from service.core.wire import attempt as wire
from service.store.attempts.tokens import AttemptRef
from service.store.checkpoints.checks import shared_record_problem
from service.store.checkpoints.crud import record_checkpoint_failure
from service.store.db import Database


class RecordRefusedError(DdpqError):
    """A checkpoint record whose file the server cannot verify (missing, another size or
    sha256, outside the job's checkpoint directory, or no shared filesystem store)."""

    status_code = 422
    code = "invalid_attempt_input"


def refuse_unverified(request: Request, ref: AttemptRef, record: wire.CheckpointRecord) -> None:
    """Verify ``record``'s file; blocking (it hashes the file), so call it from a sync route
    (FastAPI runs those in its threadpool).

    Caller: the record route, for the attempt ``ref`` its token resolved to.

    Raises:
        RecordRefusedError: the record cannot be accepted (422); the job got a
            "checkpoint at step N not written: …" event first.
        StaleAttemptError: the attempt is superseded (409, nothing noted).
    """
    settings = request.app.state.settings
    problem = shared_record_problem(
        settings.resolved_artifact_dir,
        settings.checkpoint_store,
        ref.job_id,
        path=record.path,
        staged_path=record.staged_path,
        size_bytes=record.size_bytes,
        sha256=record.sha256,
    )
    if problem is None:
        return
    # A file name may carry a lone surrogate or NUL, which neither database stores.
    problem = problem.encode("utf-8", "replace").decode("utf-8").replace("\x00", "\\0")
    db: Database = request.app.state.db
    try:
        with db.session() as session:
            record_checkpoint_failure(
                session, ref.job_id, ref.attempt, step=record.step, reason=problem
            )
    except (StaleAttemptError, NotFoundError) as exc:
        raise StaleAttemptError(f"{wire.ATTEMPT_SUPERSEDED}: {exc.detail}") from None
    raise RecordRefusedError(problem)
