"""The job resource's use cases: one function per operation, each opening its own session (a
Core read scope on the hot path) and returning values (``service.store.jobs.values``), never
ORM rows. The API's routes, the dashboard and the worker interface (``worker.control.records``) call
these; the session-taking functions of ``crud``, ``claims``, ``queue``, ``view`` and ``notes``
are their building blocks.

``owner`` is the caller's owner filter (``Caller.owner_filter``): None sees every job (an
admin, or auth off); otherwise another owner's job is "not found", never "forbidden".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Connection

from service.core.errors import NotFoundError, SpecValidationError, StaleAttemptError
from service.core.events import EventKind
from service.core.holds import ClaimedJob, ClaimedJobs, SchedulerHandle, Transition
from service.core.spec.model import JobSpec
from service.core.spec.text import display_text
from service.core.states import JobState
from service.store.attempts.goodput import job_ledger
from service.store.attempts.values import JobLedger
from service.store.auth.values import Caller
from service.store.checkpoints.crud import list_checkpoints
from service.store.checkpoints.init_from import resolve_init_from, same_submission
from service.store.db import Database
from service.store.jobs import batch_claims, claims, crud, notes
from service.store.jobs.logs import read_rank_log
from service.store.jobs.queue import explain_queue, submit_warnings
from service.store.jobs.rate_limits import check_submission_rate
from service.store.jobs.values import (
    JobEventView,
    JobPage,
    JobShape,
    JobView,
    LogChunk,
    ResumePoint,
    SubmissionPlan,
    Submitted,
)
from service.store.jobs.view import get_job_row, get_job_view
from service.store.workspaces.crud import use_workspaces

# -- the API's ----------------------------------------------------------------------------


def submit_job(
    db: Database,
    spec: JobSpec,
    caller: Caller,
    *,
    idempotency_key: str | None = None,
    per_minute: int | None = None,
    starting_launcher: str | None = None,
) -> Submitted:
    """Queue a validated ``spec`` for ``caller``, in one transaction. A replayed
    ``idempotency_key`` returns the earlier job and must come with the same spec. A new job
    counts against the owner's ``per_minute`` submissions (a replay does not; None: no
    limit). An ``init_from`` is resolved to one committed checkpoint of a job the caller may
    read. A new job no registered worker (live, silent or stopped) could ever run comes with
    a warning (``starting_launcher``: see ``queue.submit_warnings``).

    Raises:
        SpecValidationError: (422) the key was used before for a different spec; the
            ``init_from`` names no job of the caller's or no committed checkpoint of it; the
            ``workspace`` is none of the owner's.
        RateLimitedError: (429, ``retry_after_s``) over the owner's rate limit.
    """
    owner = caller.owner
    with db.session() as session:
        replay = (
            crud.find_job_by_idempotency_key(session, owner, idempotency_key)
            if idempotency_key is not None
            else None
        )
        if replay is None:
            spec = resolve_init_from(session, spec, owner=caller.owner_filter)
            if spec.workspace is not None:
                use_workspaces(session, owner, [(spec.workspace, ["body", "workspace"])])
            if per_minute is not None:
                check_submission_rate(session, owner, per_minute=per_minute)
        job, created = crud.submit_job(session, spec, owner=owner, idempotency_key=idempotency_key)
        if not created and not same_submission(job.spec, spec):
            raise _key_reused(idempotency_key or "", job.id)
        warnings: list[str] = []
        if created:
            r = spec.resources
            shape = JobShape(spec.launcher, r.gpus_per_node, r.nproc_per_node, spec.priority)
            warnings = submit_warnings(session, shape, starting_launcher=starting_launcher)
        return Submitted(JobView.of(job), created, tuple(warnings))


def _key_reused(key: str, job_id: int) -> SpecValidationError:
    return SpecValidationError(
        [
            {
                "loc": ["header", "Idempotency-Key"],
                "msg": f"Idempotency-Key {display_text(key)!r} was used for a different spec "
                f"(job {job_id}): send a new key for a new job, or the same spec to get job "
                f"{job_id} again",
                "type": "idempotency_key_reused",
            }
        ]
    )


def describe_job(
    db: Database,
    job_id: int,
    *,
    owner: str | None,
    heartbeat_interval_s: float,
    max_gpus_per_node: int = 0,
) -> JobView:
    """The job with, for one not running yet, why it waits (``JobView.queue``: a queued
    job's place and the workers that could take it, seen as ``owner`` sees other owners'
    jobs; or a submitted attempt's batch-scheduler pending reason).

    The hottest read (dashboards and CLIs poll it): a Core read (``Database.read``: no ORM
    session, retried once on a connection the database closed). Call it in the event loop's
    default executor, not through anyio's thread hop (see ``service.api.jobs.routes``).

    Raises:
        NotFoundError: no such job (or not the owner's).
    """

    def read(conn: Connection) -> JobView:
        row, explanation = get_job_view(
            conn,
            job_id,
            owner=owner,
            heartbeat_interval_s=heartbeat_interval_s,
            max_gpus_per_node=max_gpus_per_node,
        )
        return JobView.from_view_row(row, explanation)

    return db.read(read)


def get_job(db: Database, job_id: int, *, owner: str | None) -> JobView:
    """The job (a Core read, no queue explanation).

    Raises:
        NotFoundError: no such job (or not the owner's).
    """
    return db.read(lambda conn: JobView.from_view_row(get_job_row(conn, job_id, owner=owner)))


def list_jobs(
    db: Database,
    *,
    owner: str | None,
    state: JobState | None = None,
    limit: int = 50,
    before_id: int | None = None,
    q: str | None = None,
    tag: str | None = None,
) -> JobPage:
    """One page of jobs, newest first (``crud.list_jobs``: ``q`` a name substring or tag,
    ``tag`` an exact tag, every filter ANDed with ``owner``'s); page on with
    ``JobPage.next_before_id``."""
    with db.session(write=False) as session:
        jobs, next_id = crud.list_jobs(
            session, state=state, owner=owner, limit=limit, before_id=before_id, q=q, tag=tag
        )
        return JobPage(tuple(JobView.of(j) for j in jobs), next_id)


def cancel_job(db: Database, job_id: int, *, owner: str | None) -> JobView:
    """Cancel a job: a queued one at once, a started one flagged ``cancel_requested`` for its
    worker. Idempotent on a job being cancelled.

    Raises:
        NotFoundError: no such job (or not the owner's).
        ConflictError: the job already finished (409).
        StaleStateError: the job kept changing state under us (409; retry).
    """
    with db.session() as session:
        return JobView.of(crud.cancel_job(session, job_id, owner=owner))


def list_job_events(db: Database, job_id: int, *, owner: str | None) -> list[JobEventView]:
    """Every event of the job, oldest first.

    Raises:
        NotFoundError: no such job (or not the owner's).
    """
    with db.session(write=False) as session:
        crud.get_job(session, job_id, owner=owner)
        return [JobEventView.of(e) for e in crud.list_events(session, job_id)]


def plan_submission(
    db: Database,
    spec: JobSpec,
    *,
    owner: str | None,
    job_id: int | None = None,
    heartbeat_interval_s: float,
    max_gpus_per_node: int,
    starting_launcher: str | None = None,
) -> SubmissionPlan:
    """What submitting ``spec`` (validated) would do, storing nothing (a dry run): its
    ``init_from`` resolved as the submit resolves it, why it would wait, the submit's
    warnings; with ``job_id``, planned as that job's next attempt (where it would resume).

    Raises:
        NotFoundError: ``job_id`` names no job ``owner`` may see (404).
        SpecValidationError: (422) ``init_from`` would be refused by the real submit.
    """
    r = spec.resources
    resume: ResumePoint | None = None
    attempt = 1
    shape = JobShape(spec.launcher, r.gpus_per_node, r.nproc_per_node, spec.priority)
    with db.session(write=False) as session:
        spec = resolve_init_from(session, spec, owner=owner)  # the submit's own check
        if job_id is not None:
            job = crud.get_job(session, job_id, owner=owner)
            # A queued job's attempt is its next launch (a requeue already counted it).
            attempt = job.attempt if job.state == JobState.QUEUED.value else job.attempt + 1
            newest = next(iter(list_checkpoints(session, job_id)), None)
            resume = ResumePoint(
                job_id=job_id,
                attempt=attempt,
                step=newest.step if newest else None,
                epoch=newest.epoch if newest else None,
                checkpoint_attempt=newest.attempt if newest else None,
            )
            shape = JobShape(
                spec.launcher, r.gpus_per_node, r.nproc_per_node, spec.priority, job_id=job_id
            )
        explanation = explain_queue(
            session,
            shape,
            viewer=owner,
            heartbeat_interval_s=heartbeat_interval_s,
            max_gpus_per_node=max_gpus_per_node,
        )
        warnings = submit_warnings(session, shape, starting_launcher=starting_launcher)
    return SubmissionPlan(spec, attempt, resume, explanation, tuple(warnings))


def get_goodput(db: Database, job_id: int, *, owner: str | None) -> JobLedger:
    """The job's lost-work ledger (``service.store.attempts.goodput.job_ledger``).

    Raises:
        NotFoundError: no such job (or not the owner's).
    """
    with db.session(write=False) as session:
        return job_ledger(session, job_id, owner=owner)


def read_job_log(
    db: Database,
    job_id: int,
    *,
    owner: str | None,
    rank: int,
    attempt: int | None,
    offset: int,
    artifact_dir: Path,
) -> LogChunk:
    """A slice of one rank's log of the job (``attempt`` None: the current one) from byte
    ``offset``, under ``artifact_dir`` (``logs.read_rank_log``).

    Raises:
        NotFoundError: no such job (or not the owner's); an attempt after its current one, or
            a rank it does not have (the message names its attempts or ranks).
    """
    job = get_job(db, job_id, owner=owner)
    return read_rank_log(artifact_dir, job, rank=rank, attempt=attempt, offset=offset)


# -- the worker's (``worker.control.records.DatabaseRecords``) ------------------------------------


def count_claimable_jobs(db: Database, *, launcher: str, max_gpus_per_node: int, limit: int) -> int:
    """How many queued jobs a worker of ``launcher`` with ``max_gpus_per_node`` free GPUs
    could claim, counting at most ``limit`` (≥ 1): one indexed read, no write lock (the long
    poll's probe)."""
    with db.session(write=False) as session:
        return claims.count_claimable_jobs(
            session, launcher=launcher, max_gpus_per_node=max_gpus_per_node, limit=limit
        )


def claim_next_job(
    db: Database, *, worker_id: str, launcher: str, max_gpus_per_node: int, lease_s: float
) -> ClaimedJob | None:
    """Claim the next job for ``worker_id`` (one statement on PostgreSQL: ``claims``): now
    ``starting``, leased for ``lease_s`` seconds. None when nothing claimable is queued."""
    with db.session() as session:
        job = claims.claim_next_job(
            session,
            worker_id=worker_id,
            launcher=launcher,
            max_gpus_per_node=max_gpus_per_node,
            lease_s=lease_s,
        )
        return None if job is None else _claimed(job)


def claim_job_batch(
    db: Database,
    *,
    worker_id: str,
    launcher: str,
    max_gpus_per_node: int,
    lease_s: float,
    limit: int,
) -> ClaimedJobs | None:
    """Claim up to ``limit`` queued trials of one sweep (within its ``max_concurrent``), or
    one plain job (``batch_claims.claim_trial_batch``); None when nothing is claimable.

    Raises:
        ValueError: ``limit`` < 1.
    """
    with db.session() as session:
        batch = batch_claims.claim_trial_batch(
            session,
            worker_id=worker_id,
            launcher=launcher,
            max_gpus_per_node=max_gpus_per_node,
            lease_s=lease_s,
            limit=limit,
        )
        if batch is None:
            return None
        jobs = tuple(_claimed(job) for job in batch.jobs)
        return ClaimedJobs(jobs, batch.sweep_id, batch.max_concurrent)


_claimed = claims.claimed_job


def apply_transition(
    db: Database,
    t: Transition,
    *,
    worker_id: str | None = None,
    error: str | None = None,
    values: Mapping[str, Any] | None = None,
) -> JobState:
    """Apply ``t`` (one compare-and-set with its event, ``crud.apply_transition``, with the
    side ``values`` and ``error`` text); the state it produced (a requeue of a job flagged
    for cancel ends ``cancelled``).

    Raises:
        InvalidTransitionError: the table forbids ``t``.
        StaleStateError: the job had moved on.
        NotFoundError: no such job.
    """
    with db.session() as session:
        job = crud.apply_transition(
            session, t, worker_id=worker_id, error=error, values=dict(values or {}) or None
        )
        return JobState(job.state)


def record_scheduler_job_ids(db: Database, handles: Sequence[SchedulerHandle]) -> None:
    """Store detached launchers' handles as their jobs' ``scheduler_job_id`` (each fenced on
    its attempt), in one transaction."""
    with db.session() as session:
        for h in handles:
            crud.set_scheduler_job_id(session, h.job_id, h.attempt, h.scheduler_job_id)


def note_job(
    db: Database,
    job_id: int,
    attempt: int,
    kind: EventKind,
    data: Mapping[str, Any] | None = None,
    *,
    worker_id: str,
) -> bool:
    """Add a note of ``kind`` with ``data`` (``service.core.events``) to the job's events for
    ``attempt`` (no state change); False when the attempt moved on meanwhile (nothing
    written).

    Raises:
        KeyError: ``data`` lacks a field the kind's wording needs.
    """
    try:
        with db.session() as session:
            notes.record_job_note(session, job_id, attempt, kind, data, worker_id=worker_id)
    except (StaleAttemptError, NotFoundError):
        return False
    return True


def note_scheduler_pending(
    db: Database, job_id: int, attempt: int, code: str, words: str, *, worker_id: str
) -> bool:
    """Record the batch scheduler's pending reason ``code`` (``words``: in plain words) for
    ``attempt``, unless it is the newest one recorded already; False when the attempt moved
    on meanwhile (nothing written)."""
    try:
        with db.session() as session:
            notes.record_scheduler_pending(
                session, job_id, attempt, code, words, worker_id=worker_id
            )
    except (StaleAttemptError, NotFoundError):
        return False
    return True
