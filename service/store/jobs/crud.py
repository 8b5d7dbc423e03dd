"""Job operations: submit, get, list, transition, cancel (the claim is in claims.py; leases,
requeue of lost workers' jobs and adoption in leases.py).

Every state change is one compare-and-set UPDATE (``WHERE id = ? AND state = ?``) plus a
``job_events`` row in the same transaction (procrastinate's pattern).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, func, select, update
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from service.core.errors import ConflictError, JobNotFoundError, StaleStateError
from service.core.events import EventKind
from service.core.holds import Transition
from service.core.spec.model import JobSpec
from service.core.states import ACTIVE_STATES, TERMINAL_STATES, JobState, check_transition
from service.store.events import event_values, record_event, record_events
from service.store.jobs.filters import has_tag, name_or_tag
from service.store.models import Job, JobEvent, utcnow

CANCEL_TRIES = 5  # cancel_job's compare-and-set rounds against a job that keeps moving


def submit_job(
    session: Session, spec: JobSpec, *, owner: str, idempotency_key: str | None = None
) -> tuple[Job, bool]:
    """Store a validated spec as a queued job.

    Returns:
        ``(job, created)``; ``created`` is False when ``idempotency_key`` matched an earlier
        submission of the same owner, whose job is returned instead of a new one.
    """
    if idempotency_key is not None:
        existing = find_job_by_idempotency_key(session, owner, idempotency_key)
        if existing is not None:
            return existing, False
    job = Job(
        name=spec.name,
        owner=owner,
        state=JobState.QUEUED.value,
        spec=spec.model_dump(mode="json"),
        launcher=spec.launcher,
        gpus_per_node=spec.resources.gpus_per_node,
        priority=spec.priority,
        attempt=1,
        idempotency_key=idempotency_key,
        # Resolved by ``init_from.resolve_init_from`` (a concrete step) before it gets here.
        init_from_job_id=spec.init_from.job if spec.init_from is not None else None,
        init_from_step=(
            spec.init_from.step
            if spec.init_from is not None and isinstance(spec.init_from.step, int)
            else None
        ),
    )
    try:
        with session.begin_nested():
            session.add(job)
            session.flush()
    except sa_exc.IntegrityError:
        # Another request with the same key won the race; return its job.
        existing = find_job_by_idempotency_key(session, owner, idempotency_key or "")
        if existing is None:
            raise
        return existing, False
    record_event(session, job.id, 1, EventKind.SUBMITTED, from_state=None, to_state=JobState.QUEUED)
    return job, True


def find_job_by_idempotency_key(session: Session, owner: str, key: str) -> Job | None:
    """The job ``owner`` submitted with Idempotency-Key ``key``, if any."""
    return session.scalars(
        select(Job).where(Job.owner == owner, Job.idempotency_key == key)
    ).one_or_none()


def get_job(session: Session, job_id: int, *, owner: str | None = None) -> Job:
    """The job ``job_id``; with ``owner`` set, only if that owner's (else not found).

    Raises:
        JobNotFoundError: no such job (or not the owner's).
    """
    job = session.get(Job, job_id)
    if job is None or (owner is not None and job.owner != owner):
        raise JobNotFoundError(job_id)
    return job


def list_jobs(
    session: Session,
    *,
    state: JobState | None = None,
    owner: str | None = None,
    limit: int = 50,
    before_id: int | None = None,
    q: str | None = None,
    tag: str | None = None,
) -> tuple[list[Job], int | None]:
    """Jobs newest first, ``limit`` at a time; page on with the returned cursor.
    ``q``: only jobs whose name contains it (case-insensitive) or with it as a tag; ``tag``:
    only jobs with exactly this tag. Every filter is ANDed with ``owner``'s.

    Returns:
        ``(jobs, next_before_id)``; the cursor is None on the last page.
    """
    stmt = select(Job).order_by(Job.id.desc()).limit(limit + 1)
    if state is not None:
        stmt = stmt.where(Job.state == state.value)
    if owner is not None:
        stmt = stmt.where(Job.owner == owner)
    dialect = session.get_bind().dialect.name
    if q is not None:
        stmt = stmt.where(name_or_tag(dialect, q))
    if tag is not None:
        stmt = stmt.where(has_tag(dialect, tag))
    if before_id is not None:
        stmt = stmt.where(Job.id < before_id)
    jobs = list(session.scalars(stmt))
    if len(jobs) > limit:
        return jobs[:limit], jobs[limit - 1].id
    return jobs, None


def owned_job_ids(session: Session, job_ids: Sequence[int], owner: str) -> set[int]:
    """The ids among ``job_ids`` whose job belongs to ``owner``."""
    if not job_ids:
        return set()
    rows = session.scalars(select(Job.id).where(Job.id.in_(set(job_ids)), Job.owner == owner))
    return set(rows)


def list_events(session: Session, job_id: int) -> list[JobEvent]:
    """A job's events, oldest first."""
    return list(
        session.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id))
    )


def apply_transition(
    session: Session,
    t: Transition,
    *,
    worker_id: str | None = None,
    error: str | None = None,
    values: dict[str, Any] | None = None,
) -> Job:
    """Apply ``t`` as one compare-and-set UPDATE plus its event row.

    Side values follow the target: ``running`` stamps ``started_at``; a terminal state stamps
    ``finished_at`` and releases the worker; ``queued`` (a relaunch) bumps ``attempt`` and
    releases the worker. ``error`` sets the job's error text.

    A requeue of a job whose cancel was requested ends it ``cancelled`` instead (reason
    ``"cancel requested (instead of: <t.reason>)"``, ``error`` and ``values`` dropped), so an
    accepted cancel survives a lost or stopped worker, a retry and a preemption. Read the
    returned job's ``state`` for what was applied.

    Raises:
        InvalidTransitionError: the table forbids ``expected → target``.
        StaleStateError: the job was not in ``expected`` any more (someone else moved it).
        NotFoundError: no such job.
    """
    return apply_transition_where(session, t, worker_id=worker_id, error=error, values=values)[0]


def apply_transition_where(
    session: Session,
    t: Transition,
    *,
    worker_id: str | None = None,
    error: str | None = None,
    values: dict[str, Any] | None = None,
    where: Sequence[ColumnElement[bool]] = (),
) -> tuple[Job, Transition]:
    """``apply_transition`` with extra compare-and-set ``where`` conditions (e.g. the lease
    still expired, for the reaper in ``service.store.workers.leases``).

    Returns:
        The job and the transition actually applied (``t``, or its cancel instead of a
        requeue).
    Raises:
        The errors of ``apply_transition``; StaleStateError also when ``where`` no longer
        holds.
    """
    check_transition(t.expected, t.target)
    if t.target != JobState.QUEUED:
        job = _compare_and_set(session, t, worker_id, error, values, where)
        if job is not None:
            return job, t
    else:
        # Two compare-and-sets on the flag: it only ever goes False → True while the job is
        # active (``cancel_job``), so one of them matches unless the state itself moved.
        not_cancelled = [*where, Job.cancel_requested.is_(False)]
        job = _compare_and_set(session, t, worker_id, error, values, not_cancelled)
        if job is not None:
            return job, t
        instead: dict[str, Any] = {"instead_of": t.reason or "requeue"}
        if t.kind is not None:
            instead["requeue_kind"] = t.kind.value
        cancel = Transition.of(
            t.job_id,
            t.expected,
            JobState.CANCELLED,
            EventKind.CANCELLED_INSTEAD_OF_REQUEUE,
            instead,
        )
        cancelled = [*where, Job.cancel_requested.is_(True)]
        job = _compare_and_set(session, cancel, worker_id, None, None, cancelled)
        if job is not None:
            return job, cancel
    current = session.scalar(select(Job.state).where(Job.id == t.job_id))
    if current is None:
        raise JobNotFoundError(t.job_id)
    raise StaleStateError(t.job_id, t.expected, current)


def _compare_and_set(
    session: Session,
    t: Transition,
    worker_id: str | None,
    error: str | None,
    values: dict[str, Any] | None,
    where: Sequence[ColumnElement[bool]],
) -> Job | None:
    """One ``UPDATE … WHERE id = ? AND state = ? [AND where…]`` plus its event; None when no
    row matched (nothing written)."""
    now = utcnow()
    vals: dict[str, Any] = {"state": t.target.value, "updated_at": now}
    if t.target == JobState.RUNNING:
        vals["started_at"] = func.coalesce(Job.started_at, now)
    if t.target in TERMINAL_STATES:
        vals.update(finished_at=now, lease_expires_at=None)
    if t.target == JobState.QUEUED:
        vals.update(
            attempt=Job.attempt + 1,
            worker_id=None,
            lease_expires_at=None,
            scheduler_job_id=None,
        )
    if error is not None:
        vals["error"] = error
    vals.update(values or {})
    # The job comes back from the UPDATE itself and its event is a Core INSERT: a reload
    # and a unit-of-work flush after it were most of a worker's transition request's CPU.
    job = session.scalars(
        update(Job)
        .where(Job.id == t.job_id, Job.state == t.expected.value, *where)
        .values(**vals)
        .returning(Job),
        execution_options={"synchronize_session": False, "populate_existing": True},
    ).one_or_none()
    if job is None:
        return None
    kind, data = t.event()
    record_events(
        session,
        [
            event_values(
                t.job_id, job.attempt, kind, data, from_state=t.expected.value,
                to_state=t.target.value, worker_id=worker_id,
            )
        ],
    )  # fmt: skip
    return job


def cancel_job(session: Session, job_id: int, *, owner: str | None = None) -> Job:
    """Cancel a job: a queued one at once; a started one gets ``cancel_requested`` for its
    worker to act on. Idempotent on a job already being cancelled.

    The flag is set only on an active (``starting``/``running``) job, by a compare-and-set
    on the state: a job requeued meanwhile is cancelled at once instead, so no queued job
    ever carries the flag.

    Raises:
        JobNotFoundError: no such job (or not the owner's).
        ConflictError: the job already finished (HTTP 409).
        StaleStateError: the job kept changing state under us (retry the call).
    """
    active = [s.value for s in ACTIVE_STATES]
    for _ in range(CANCEL_TRIES):
        job = get_job(session, job_id, owner=owner)
        state = JobState(job.state)
        if state.is_terminal:
            raise ConflictError(f"job {job_id} already {state}; nothing to cancel")
        if state == JobState.QUEUED:
            with contextlib.suppress(StaleStateError):  # claimed meanwhile: flag it instead
                return apply_transition(
                    session,
                    Transition.of(
                        job_id, state, JobState.CANCELLED, EventKind.CANCELLED_WHILE_QUEUED
                    ),
                )
        else:
            row = session.execute(
                update(Job)
                .where(Job.id == job_id, Job.state.in_(active))
                .values(cancel_requested=True, updated_at=utcnow())
                .returning(Job.id)
                .execution_options(synchronize_session=False)
            ).one_or_none()
            if row is not None:
                session.flush()
                refreshed = session.get(Job, job_id, populate_existing=True)
                assert refreshed is not None
                return refreshed
        session.expire(job)  # it moved under us: read it again
    raise StaleStateError(job_id, state)


def cancel_flagged_queued_jobs(session: Session, *, limit: int = 100) -> list[Transition]:
    """Cancel queued jobs that carry ``cancel_requested`` (none should: a requeue of a
    flagged job cancels it instead; this mends rows written before that rule). At most
    ``limit`` jobs per call.

    Returns:
        The transitions applied.
    """
    ids = session.scalars(
        select(Job.id)
        .where(Job.state == JobState.QUEUED.value, Job.cancel_requested.is_(True))
        .order_by(Job.id)
        .limit(limit)
    ).all()
    done: list[Transition] = []
    for job_id in ids:
        t = Transition.of(job_id, JobState.QUEUED, JobState.CANCELLED, EventKind.CANCELLED)
        if _compare_and_set(session, t, None, None, None, [Job.cancel_requested.is_(True)]):
            done.append(t)
    return done


def set_scheduler_job_id(
    session: Session, job_id: int, attempt: int, scheduler_job_id: str
) -> None:
    """Record Slurm's id for the current attempt (fenced on ``attempt``)."""
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.attempt == attempt)
        .values(scheduler_job_id=scheduler_job_id, updated_at=utcnow())
    )
