"""Sweep operations: submit (every trial an ordinary queued job, all in one transaction),
get, list, trials, cancel, retry-failed, extend. What moves a running sweep on (max_failed,
ASHA, its end state) is in ``sweep_progress``.

A trial is a ``sweep_trials`` row keyed by the sha256 of its overrides; its job is an
ordinary ``jobs`` row carrying ``sweep_id`` and ``trial_key``. Retrying a failed trial makes
a new job for the same key (terminal states never change): the trial points at its newest
job and counts them in ``attempts``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session

from service.core.errors import ConflictError, SweepNotFoundError
from service.core.events import EventKind, render
from service.core.states import (
    ACTIVE_STATES,
    TERMINAL_STATES,
    JobState,
    SweepState,
    check_sweep_transition,
    check_transition,
)
from service.core.sweeps.spec import PlannedTrial, ResolvedObjective, SweepSpec
from service.store.events import event_values, record_events
from service.store.jobs.claims import lock_sweep_claims
from service.store.jobs.rate_limits import check_jobs_rate
from service.store.models import Job, Sweep, SweepTrial, utcnow
from service.store.sweeps.init_from import init_from_columns, retry_start


def move_sweep(sweep: Sweep, target: SweepState) -> None:
    """Set ``sweep.state`` to ``target`` as ``SWEEP_TRANSITIONS`` allows (nothing to do when
    it is there already). Raises InvalidTransitionError (HTTP 409) for a move the table lacks."""
    current = SweepState(sweep.state)
    if current != target:
        check_sweep_transition(current, target)
        sweep.state = target.value


def submit_sweep(
    session: Session,
    spec: SweepSpec,
    objective: ResolvedObjective,
    planned: Sequence[PlannedTrial],
    *,
    owner: str,
) -> Sweep:
    """Store a sweep and its validated trials as queued jobs: one transaction, three bulk
    INSERTs (jobs with their ids returned, their ``queued`` events, the trial rows). Trials'
    ``init_from`` must be resolved already (``sweep_init_from.resolve_sweep_init_from``)."""
    return submit_sweep_once(session, spec, objective, planned, owner=owner)[0]


def submit_sweep_once(
    session: Session,
    spec: SweepSpec,
    objective: ResolvedObjective,
    planned: Sequence[PlannedTrial],
    *,
    owner: str,
    idempotency_key: str | None = None,
) -> tuple[Sweep, bool]:
    """``submit_sweep`` under an Idempotency-Key (None: none).

    Returns:
        ``(sweep, created)``; ``created`` is False when another request with the same
        ``idempotency_key`` (same owner) stored its sweep first: that one is returned.
    """
    sweep = Sweep(
        name=spec.name,
        owner=owner,
        state=SweepState.RUNNING.value,
        spec=spec.model_dump(mode="json"),
        objective=objective.as_dict(),
        max_concurrent=spec.max_concurrent,
        max_failed=spec.max_failed,
        idempotency_key=idempotency_key,
    )
    try:
        with session.begin_nested():
            session.add(sweep)
            session.flush()
    except sa_exc.IntegrityError:
        existing = find_sweep_by_idempotency_key(session, owner, idempotency_key or "")
        if existing is None:
            raise
        return existing, False
    insert_trials(session, sweep, planned)
    return sweep, True


def find_sweep_by_idempotency_key(session: Session, owner: str, key: str) -> Sweep | None:
    """The sweep ``owner`` submitted with Idempotency-Key ``key``, if any."""
    return session.scalars(
        select(Sweep).where(Sweep.owner == owner, Sweep.idempotency_key == key)
    ).one_or_none()


def same_sweep(stored: dict[str, Any], spec: SweepSpec) -> bool:
    """Whether a replayed submit (same Idempotency-Key) sent the sweep stored as ``stored``:
    a base ``init_from`` of step ``"latest"`` (or without a sha256) matches the checkpoint
    it was resolved to then."""
    sent = spec.model_dump(mode="json")
    init, was = sent["base"].get("init_from"), stored.get("base", {}).get("init_from")
    if isinstance(init, dict) and isinstance(was, dict):
        init = {"step": "latest", "mode": "weights_only", "sha256": None} | init
        if init["step"] == "latest":
            init["step"] = was.get("step")
        if init["sha256"] is None:
            init["sha256"] = was.get("sha256")
        sent["base"] = sent["base"] | {"init_from": init}
    return bool(sent == stored)


def insert_trials(session: Session, sweep: Sweep, planned: Sequence[PlannedTrial]) -> int:
    """Bulk-insert ``planned`` trials of ``sweep`` (jobs, events, trial rows); the count."""
    if not planned:
        return 0
    now = utcnow()
    job_rows = [
        {
            "name": t.spec.name,
            "owner": sweep.owner,
            "state": JobState.QUEUED.value,
            "spec": t.spec.model_dump(mode="json"),
            "launcher": t.spec.launcher,
            "gpus_per_node": t.spec.resources.gpus_per_node,
            "priority": t.spec.priority,
            "attempt": 1,
            "restarts": 0,
            "cancel_requested": False,
            "sweep_id": sweep.id,
            "trial_key": t.key,
            "created_at": now,
            "updated_at": now,
            **init_from_columns(t.spec),
        }
        for t in planned
    ]
    ids = session.scalars(
        insert(Job).returning(Job.id, sort_by_parameter_order=True), job_rows
    ).all()
    record_events(
        session,
        [
            event_values(
                i,
                1,
                EventKind.TRIAL_SUBMITTED,
                {"sweep_id": sweep.id, "position": t.position},
                from_state=None,
                to_state=JobState.QUEUED.value,
                created_at=now,
            )
            for i, t in zip(ids, planned, strict=True)
        ],
    )
    session.execute(
        insert(SweepTrial),
        [
            {
                "sweep_id": sweep.id,
                "trial_key": t.key,
                "position": t.position,
                "overrides": t.overrides,
                "job_id": i,
                "attempts": 1,
            }
            for i, t in zip(ids, planned, strict=True)
        ],
    )
    return len(ids)


def get_sweep(session: Session, sweep_id: int, *, owner: str | None = None) -> Sweep:
    """The sweep ``sweep_id``; with ``owner`` set, only if that owner's.

    Raises:
        SweepNotFoundError: no such sweep (or not the owner's).
    """
    sweep = session.get(Sweep, sweep_id)
    if sweep is None or (owner is not None and sweep.owner != owner):
        raise SweepNotFoundError(sweep_id)
    return sweep


def list_sweeps(
    session: Session, *, owner: str | None, limit: int = 50, before_id: int | None = None
) -> tuple[list[Sweep], int | None]:
    """Sweeps newest first, ``limit`` at a time; ``(sweeps, next_before_id or None)``."""
    stmt = select(Sweep).order_by(Sweep.id.desc()).limit(limit + 1)
    if owner is not None:
        stmt = stmt.where(Sweep.owner == owner)
    if before_id is not None:
        stmt = stmt.where(Sweep.id < before_id)
    sweeps = list(session.scalars(stmt))
    if len(sweeps) > limit:
        return sweeps[:limit], sweeps[limit - 1].id
    return sweeps, None


def cancel_sweep_jobs(
    session: Session, sweep_id: int, kind: EventKind, data: dict[str, Any]
) -> tuple[int, int]:
    """End every unfinished trial job of a sweep: queued ones cancelled at once (a set-wise
    compare-and-set on ``state = 'queued'`` with an event each), started ones flagged
    ``cancel_requested`` for their workers (with an event saying why). The events are of
    ``kind`` (``sweep_cancelled`` or ``sweep_stopped``) with ``data``; a flag's carries
    ``cancel_requested: true`` too.

    Returns:
        ``(cancelled_now, cancel_requested)`` counts.
    """
    check_transition(JobState.QUEUED, JobState.CANCELLED)
    now = utcnow()
    cancelled = session.execute(
        update(Job)
        .where(Job.sweep_id == sweep_id, Job.state == JobState.QUEUED.value)
        .values(state=JobState.CANCELLED.value, finished_at=now, updated_at=now)
        .returning(Job.id, Job.attempt)
        .execution_options(synchronize_session=False)
    ).all()
    flagged = session.execute(
        update(Job)
        .where(
            Job.sweep_id == sweep_id,
            Job.state.in_([s.value for s in ACTIVE_STATES]),
            Job.cancel_requested.is_(False),
        )
        .values(cancel_requested=True, updated_at=now)
        .returning(Job.id, Job.attempt, Job.state)
        .execution_options(synchronize_session=False)
    ).all()
    flag = {**data, "cancel_requested": True}
    events = [
        event_values(
            i,
            a,
            kind,
            data,
            from_state=JobState.QUEUED.value,
            to_state=JobState.CANCELLED.value,
            created_at=now,
        )
        for i, a in cancelled
    ] + [
        event_values(i, a, kind, flag, from_state=s, to_state=s, created_at=now)
        for i, a, s in flagged
    ]
    record_events(session, events)
    session.expire_all()
    return len(cancelled), len(flagged)


def cancel_sweep(session: Session, sweep_id: int, *, owner: str | None, by: str) -> Sweep:
    """Cancel a sweep: its state becomes ``cancelled`` at once and every unfinished trial is
    cancelled (``cancel_sweep_jobs``); ``finished_at`` is set once every trial has ended
    (now, or by the reaper's ``finish_cancelled`` when started trials were still
    stopping). Idempotent.

    Raises:
        SweepNotFoundError: no such sweep (or not the owner's).
        ConflictError: the sweep already ended succeeded or failed (HTTP 409).
    """
    sweep = get_sweep(session, sweep_id, owner=owner)
    if sweep.state in (SweepState.SUCCEEDED, SweepState.FAILED):
        raise ConflictError(f"sweep {sweep_id} already {sweep.state}; nothing to cancel")
    why = {"sweep_id": sweep_id, "by": by}
    reason = render(EventKind.SWEEP_CANCELLED, why)
    cancel_sweep_jobs(session, sweep_id, EventKind.SWEEP_CANCELLED, why)
    if sweep.state != SweepState.CANCELLED:
        move_sweep(sweep, SweepState.CANCELLED)
        sweep.stop_reason = reason
    finish_cancelled(session, sweep)
    session.flush()
    return sweep


def finish_cancelled(session: Session, sweep: Sweep) -> bool:
    """Set a cancelled sweep's ``finished_at`` once every trial's newest job has ended: the
    newest of their ``finished_at`` (now if none has one). Whether it is set."""
    if sweep.finished_at is not None:
        return True
    states = session.execute(
        select(Job.state, Job.finished_at)
        .select_from(SweepTrial)
        .outerjoin(Job, Job.id == SweepTrial.job_id)
        .where(SweepTrial.sweep_id == sweep.id)
    ).all()
    if not all(is_terminal_state(state) for state, _ in states):
        return False
    sweep.finished_at = max((f for _, f in states if f is not None), default=None) or utcnow()
    return True


def lock_sweep(session: Session, sweep_id: int) -> None:
    """Serialise writers of one sweep's trials (retry-failed, extend, and the claims) until
    this transaction ends: the per-sweep claim lock (PostgreSQL advisory lock; SQLite's
    ``BEGIN IMMEDIATE`` serialises every writer already). Take it before reading the trials,
    so the reads see what a concurrent retry or extend committed."""
    lock_sweep_claims(session, sweep_id)


def retry_failed(
    session: Session, sweep_id: int, *, owner: str | None, per_minute: int | None = None
) -> int:
    """Queue a new job for every trial whose newest job failed (same trial key; the failed
    job stays as it was). The new job continues from the failed job's own newest committed
    checkpoint (``init_from`` it, mode ``full``; pinned against retention while it runs)
    when there is one, else it starts over with the same spec. The sweep runs again
    (``stop_reason`` cleared). With ``per_minute`` set the new jobs count against the
    sweep owner's submission rate limit (``check_submission_rate``).

    Returns:
        How many trials were re-queued.
    Raises:
        SweepNotFoundError: no such sweep (or not the owner's).
        ConflictError: the sweep was cancelled (HTTP 409).
        RateLimitedError: the new jobs do not fit the rate limit now (HTTP 429).
        SpecValidationError: more failed trials than ``per_minute`` (HTTP 422).
    """
    # Concurrent retries would each see the same failed trials and queue a job for each.
    lock_sweep(session, sweep_id)
    sweep = get_sweep(session, sweep_id, owner=owner)
    if sweep.state == SweepState.CANCELLED:
        raise ConflictError(f"sweep {sweep_id} was cancelled; submit it again to re-run it")
    failed = session.execute(
        select(SweepTrial, Job)
        .join(Job, Job.id == SweepTrial.job_id)
        .where(SweepTrial.sweep_id == sweep_id, Job.state == JobState.FAILED.value)
        .order_by(SweepTrial.position)
    ).all()
    if not failed:
        return 0
    check_jobs_rate(session, sweep.owner, per_minute=per_minute, jobs=len(failed))
    now = utcnow()
    specs = [retry_start(session, j) for _, j in failed]
    rows = [
        {
            "name": j.name,
            "owner": j.owner,
            "state": JobState.QUEUED.value,
            "spec": spec,
            "launcher": j.launcher,
            "gpus_per_node": j.gpus_per_node,
            "priority": j.priority,
            "attempt": 1,
            "restarts": 0,
            "cancel_requested": False,
            "sweep_id": sweep_id,
            "trial_key": t.trial_key,
            "created_at": now,
            "updated_at": now,
            **init_from_columns(spec),
        }
        for (t, j), spec in zip(failed, specs, strict=True)
    ]
    ids = session.scalars(insert(Job).returning(Job.id, sort_by_parameter_order=True), rows).all()
    record_events(
        session,
        [
            event_values(
                new,
                1,
                EventKind.TRIAL_RETRIED,
                {"sweep_id": sweep_id, "position": t.position, "failed_job_id": j.id}
                | _continuing(spec, j.id),
                from_state=None,
                to_state=JobState.QUEUED.value,
                created_at=now,
            )
            for new, (t, j), spec in zip(ids, failed, specs, strict=True)
        ],
    )
    for new, (t, _) in zip(ids, failed, strict=True):
        t.job_id, t.attempts, t.outcome = new, t.attempts + 1, None
    move_sweep(sweep, SweepState.RUNNING)
    sweep.stop_reason, sweep.finished_at = None, None
    session.flush()
    return len(ids)


def _continuing(spec: dict[str, object], failed_id: int) -> dict[str, object]:
    """``{"continuing_from_step": step}`` when the retry starts from the failed job's
    checkpoint (its event says so), else nothing."""
    init = spec.get("init_from")
    if isinstance(init, dict) and init.get("job") == failed_id:
        return {"continuing_from_step": init.get("step")}
    return {}


def trial_keys(session: Session, sweep_id: int) -> tuple[frozenset[str], int]:
    """The keys a sweep holds and the next free position."""
    rows = session.execute(
        select(SweepTrial.trial_key, SweepTrial.position).where(SweepTrial.sweep_id == sweep_id)
    ).all()
    return frozenset(k for k, _ in rows), max((p for _, p in rows), default=-1) + 1


def extend_sweep(
    session: Session, sweep: Sweep, spec: SweepSpec, planned: Sequence[PlannedTrial]
) -> int:
    """Store the extended ``spec`` and add the ``planned`` trials (only keys the sweep did
    not hold: ``plan_trials(skip_keys=…)``); a finished sweep runs again.

    Raises:
        ConflictError: the sweep was cancelled (HTTP 409).
    """
    if sweep.state == SweepState.CANCELLED:
        raise ConflictError(f"sweep {sweep.id} was cancelled; submit a new sweep instead")
    sweep.spec = spec.model_dump(mode="json")
    added = insert_trials(session, sweep, planned)
    if added and sweep.state in (SweepState.SUCCEEDED, SweepState.FAILED):
        move_sweep(sweep, SweepState.RUNNING)
        sweep.finished_at = None
    session.flush()
    return added


def is_terminal_state(job_state: str | None) -> bool:
    """Whether a trial whose newest job is in ``job_state`` has ended (None: its job was
    deleted)."""
    return job_state is None or job_state in {s.value for s in TERMINAL_STATES}
