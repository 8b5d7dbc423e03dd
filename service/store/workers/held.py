"""What a worker may do through the worker API: act for itself, with the token it registered
with, on the jobs it holds (``jobs.worker_id``), and nothing else.

``find_worker_caller`` is the worker routes' one lookup per request: the token (live, a
worker's) and the worker row it registered, in one statement. ``check_held`` is the fence of
every write on a job: this worker holds it, at this attempt, and it is active.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from sqlalchemy import Connection, Table, and_, insert, select, update
from sqlalchemy.orm import Session

from service.core.errors import NotHeldError, WorkerTokenRefusedError
from service.core.holds import ClaimedJob, SchedulerHandle
from service.core.states import ACTIVE_STATES
from service.core.tokens import hash_token
from service.store.attempts.tokens import mint_attempt_token, new_attempt_token
from service.store.auth.tokens import MAX_TOKEN_CHARS, WORKER
from service.store.models import ApiToken, AttemptToken, Job, Worker, utcnow
from service.store.workers.values import WorkerCaller

_ACTIVE = [s.value for s in ACTIVE_STATES]


def find_worker_caller(
    conn: Session | Connection, token: str, worker_id: str
) -> WorkerCaller | None:
    """Who calls the worker API: the live worker token ``token`` and the row of
    ``worker_id`` (if registered; its launcher and the token it registered with). None for an
    unknown, revoked, malformed or non-worker token. One indexed statement, no cache."""
    if not token or len(token) > MAX_TOKEN_CHARS:
        return None
    row = conn.execute(
        select(ApiToken.id, Worker.id.label("worker"), Worker.token_id, Worker.launcher)
        .select_from(ApiToken)
        .outerjoin(Worker, Worker.id == worker_id)
        .where(
            ApiToken.token_hash == hash_token(token),
            ApiToken.revoked_at.is_(None),
            ApiToken.kind == WORKER,
        )
    ).one_or_none()
    if row is None:
        return None
    return WorkerCaller(
        token_id=row.id,
        worker_id=worker_id,
        registered=row.worker is not None,
        registered_token_id=row.token_id,
        launcher=row.launcher,
    )


def check_token_live(session: Session, token_id: int) -> None:
    """The fence of a claim on the worker token: still live. The row is read ``FOR SHARE``
    on PostgreSQL, so a revocation commits either before the claim (which then claims
    nothing) or after it: a long poll that began before the revocation claims nothing once
    ``ddpq token revoke`` has returned.

    Raises:
        WorkerTokenRefusedError: the token was revoked (or deleted) meanwhile (401).
    """
    live = session.scalar(
        select(ApiToken.id)
        .where(ApiToken.id == token_id, ApiToken.revoked_at.is_(None))
        .with_for_update(read=True)
    )
    if live is None:
        raise WorkerTokenRefusedError("unknown or revoked worker token")


def check_held(session: Session, job_id: int, attempt: int, worker_id: str) -> None:
    """The fence of a worker's write on a job: ``worker_id`` holds it, ``attempt`` is its
    current attempt and it is active (starting/running).

    Raises:
        NotHeldError: otherwise (404, the same answer whether or not the job exists).
    """
    held = session.scalar(
        select(Job.id).where(
            Job.id == job_id,
            Job.worker_id == worker_id,
            Job.attempt == attempt,
            Job.state.in_(_ACTIVE),
        )
    )
    if held is None:
        raise NotHeldError(f"job {job_id} attempt {attempt} is not held by worker {worker_id}")


def mint_claim_tokens(session: Session, jobs: Sequence[ClaimedJob]) -> list[ClaimedJob]:
    """``jobs`` each with a new attempt token for its ranks (only the hash stored), minted in
    the claim's own transaction: one INSERT for them all (a worker with free slots claims
    several jobs at once), rows as ``mint_attempt_token`` writes them."""
    if len(jobs) == 1:
        (job,) = jobs
        return [replace(job, attempt_token=mint_attempt_token(session, job.job_id, job.attempt))]
    if not jobs:
        return []
    minted = [replace(j, attempt_token=new_attempt_token()) for j in jobs]
    rows = [
        {"job_id": j.job_id, "attempt": j.attempt, "token_hash": hash_token(j.attempt_token)}
        for j in minted
    ]
    table: Table = AttemptToken.__table__  # type: ignore[assignment]
    session.execute(insert(table).values(rows))
    return minted


def record_held_handles(
    session: Session, handles: Sequence[SchedulerHandle], worker_id: str
) -> int:
    """Store each handle as its job's ``scheduler_job_id`` where ``worker_id`` holds the job
    at that attempt and it is active; how many were stored (a handle of a job moved on, or
    ended, is dropped)."""
    stored = 0
    for h in handles:
        result = session.execute(
            update(Job)
            .where(
                and_(
                    Job.id == h.job_id,
                    Job.attempt == h.attempt,
                    Job.worker_id == worker_id,
                    Job.state.in_(_ACTIVE),
                )
            )
            .values(scheduler_job_id=h.scheduler_job_id, updated_at=utcnow())
            .execution_options(synchronize_session=False)
        )
        stored += int(result.rowcount or 0)  # type: ignore[attr-defined]
    return stored
