"""The sweep resource's use cases, each opening its own session and returning values
(``service.store.sweeps.values``): submit, list, get, trials, cancel, retry-failed, extend,
one metric's curves of all trials, and the reaper's pass over running sweeps. The
session-taking functions of ``crud``, ``view``, ``init_from``, ``metrics`` and ``progress``
are their building blocks.

``owner`` is the caller's owner filter (None: every sweep); another owner's sweep is "not
found". ``per_minute`` is the owner's submission limit (None: none, as with auth off); every
trial a call adds counts as one job against it.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.orm import Session

from service.core.config import Settings
from service.core.errors import SpecValidationError
from service.core.spec.text import display_text
from service.core.sweeps.spec import (
    SweepExtension,
    SweepSpec,
    extended_spec,
    plan_trials,
    resolve_objective,
)
from service.core.sweeps.trials import next_changed_since
from service.store.auth.values import Caller
from service.store.db import Database
from service.store.jobs.rate_limits import check_jobs_rate
from service.store.models import Sweep, utcnow
from service.store.sweeps import columns, crud, metrics, progress, table, view
from service.store.sweeps.init_from import resolve_sweep_init_from, trial_workspaces
from service.store.sweeps.values import (
    SubmittedSweep,
    SweepDetail,
    SweepInfo,
    SweepPage,
    TrialCurve,
    TrialPage,
    TrialQuery,
    TrialView,
)
from service.store.workspaces.crud import use_workspaces


def _detail(session: Session, sweep: Sweep, added: int | None = None) -> SweepDetail:
    """``sweep`` with its best trial and counts by outcome: two queries that read one row
    and one row per outcome, not every trial (a poll of a 10,000-trial sweep reads it)."""
    counts = view.outcome_counts(session, sweep)
    best = view.best_trial(session, sweep)
    return SweepDetail(SweepInfo.of(sweep), sum(counts.values()), best, counts, added)


def submit_sweep(
    db: Database,
    spec: SweepSpec,
    caller: Caller,
    *,
    settings: Settings,
    idempotency_key: str | None = None,
    per_minute: int | None = None,
) -> SubmittedSweep:
    """Expand the sweep and validate every trial (against ``settings``) before anything is
    stored, then store the sweep and all its trials as queued jobs in one transaction. Every
    trial's ``init_from`` is resolved as ``POST /jobs`` resolves a job's. A replayed
    ``idempotency_key`` returns the sweep it made (and counts nothing against the limit).

    Raises:
        SpecValidationError: (422) a trial is invalid (nothing stored); more trials than
            ``per_minute``; the key was used before for a different sweep.
        RateLimitedError: (429, ``retry_after_s``) the trials do not fit the last minute.
    """
    owner = caller.owner
    with db.session() as session:
        replay = (
            crud.find_sweep_by_idempotency_key(session, owner, idempotency_key)
            if idempotency_key is not None
            else None
        )
        if replay is None:
            planned = plan_trials(spec, settings)
            objective = resolve_objective(spec)
            check_jobs_rate(session, owner, per_minute=per_minute, jobs=len(planned))
            resolved, planned = resolve_sweep_init_from(
                session, spec, planned, owner=caller.owner_filter
            )
            use_workspaces(session, owner, trial_workspaces(planned))
            sweep, created = crud.submit_sweep_once(
                session, resolved, objective, planned, owner=owner, idempotency_key=idempotency_key
            )
        else:
            sweep, created = replay, False
        if not created and not crud.same_sweep(sweep.spec, spec):
            raise _key_reused(idempotency_key or "", sweep.id)
        return SubmittedSweep(_detail(session, sweep), created)


def _key_reused(key: str, sweep_id: int) -> SpecValidationError:
    return SpecValidationError(
        [
            {
                "loc": ["header", "Idempotency-Key"],
                "msg": f"Idempotency-Key {display_text(key)!r} was used for a different "
                f"sweep (sweep {sweep_id}): send a new key for a new sweep, or the same "
                f"sweep to get sweep {sweep_id} again",
                "type": "idempotency_key_reused",
            }
        ]
    )


def list_sweeps(
    db: Database, *, owner: str | None, limit: int = 50, before_id: int | None = None
) -> SweepPage:
    """One page of sweeps, newest first, each with its trials."""
    with db.session(write=False) as session:
        sweeps, next_id = crud.list_sweeps(session, owner=owner, limit=limit, before_id=before_id)
        return SweepPage(tuple(_detail(session, s) for s in sweeps), next_id)


def get_sweep(db: Database, sweep_id: int, *, owner: str | None) -> SweepInfo:
    """The sweep's own row (no trials).

    Raises:
        NotFoundError: no such sweep (or not the owner's).
    """
    with db.session(write=False) as session:
        return SweepInfo.of(crud.get_sweep(session, sweep_id, owner=owner))


def describe_sweep(db: Database, sweep_id: int, *, owner: str | None) -> SweepDetail:
    """The sweep with its trials, best trial and counts by outcome.

    Raises:
        NotFoundError: no such sweep (or not the owner's).
    """
    with db.session(write=False) as session:
        return _detail(session, crud.get_sweep(session, sweep_id, owner=owner))


def list_trials(db: Database, sweep_id: int, *, owner: str | None) -> list[TrialView]:
    """Every trial of the sweep in position order (newest job per key).

    Raises:
        NotFoundError: no such sweep (or not the owner's).
    """
    with db.session(write=False) as session:
        return view.list_trials(session, crud.get_sweep(session, sweep_id, owner=owner))


def list_trial_page(
    db: Database, sweep_id: int, query: TrialQuery, *, owner: str | None
) -> TrialPage:
    """One page of the sweep's trials table as ``query`` says (sorted on the server, missing
    values last, ties in position order: in SQL for ``columns.SQL_SORTS``, else
    ``table.page_of``), or with ``query.changed_since`` the trials whose job
    changed since then; the page says the ``changed_since`` of the next delta poll.

    Raises:
        NotFoundError: no such sweep (or not the owner's).
        ValueError: ``query.sort`` is not a column of the table.
    """
    # Taken before the read: a row stamped after this is in this answer or the next one's.
    read_started_at = utcnow()
    since = query.changed_since
    with db.session(write=False) as session:
        sweep = crud.get_sweep(session, sweep_id, owner=owner)
        if query.sort in columns.SQL_SORTS:
            # Sorted and cut in SQL, not after reading every trial.
            rows = view.list_trials(
                session,
                sweep,
                changed_since=since,
                sort=query.sort,
                descending=query.descending,
                offset=query.offset,
                limit=query.limit,
            )
            whole = query.limit is None and query.offset == 0
            total = len(rows) if whole else view.count_trials(session, sweep, changed_since=since)
        else:
            # Run time (from now) and overrides (values of mixed types): sorted in Python.
            trials = view.list_trials(session, sweep, changed_since=since)
            rows, total = table.page_of(trials, query), len(trials)
    end = query.offset + len(rows)
    return TrialPage(
        tuple(rows),
        total,
        query.offset,
        end if end < total else None,
        next_changed_since(read_started_at),
    )


def cancel_sweep(db: Database, sweep_id: int, *, owner: str | None, by: str) -> SweepDetail:
    """Cancel the sweep (``crud.cancel_sweep``: queued trials at once, started ones flagged),
    ``by`` the owner named in its stop reason. Idempotent.

    Raises:
        NotFoundError: no such sweep (or not the owner's).
        ConflictError: the sweep already ended succeeded or failed (409).
    """
    with db.session() as session:
        sweep = crud.cancel_sweep(session, sweep_id, owner=owner, by=by)
        return _detail(session, sweep)


def retry_failed_trials(
    db: Database, sweep_id: int, *, owner: str | None, per_minute: int | None = None
) -> SweepDetail:
    """A new job for every trial whose newest job failed (``crud.retry_failed``); the
    sweep with ``added`` = how many.

    Raises:
        NotFoundError: no such sweep (or not the owner's).
        ConflictError: the sweep was cancelled (409).
        RateLimitedError: the new jobs do not fit the rate limit now (429).
        SpecValidationError: more failed trials than ``per_minute`` (422).
    """
    with db.session() as session:
        added = crud.retry_failed(session, sweep_id, owner=owner, per_minute=per_minute)
        sweep = crud.get_sweep(session, sweep_id, owner=owner)
        return _detail(session, sweep, added)


def extend_sweep(
    db: Database,
    sweep_id: int,
    ext: SweepExtension,
    caller: Caller,
    *,
    settings: Settings,
    per_minute: int | None = None,
) -> SweepDetail:
    """Add grid values to existing axes, or raise samples/seeds: only trials whose key the
    sweep does not hold yet are added (each validated against ``settings`` first, its
    ``init_from`` resolved for ``caller``); the sweep with ``added`` = how many.

    Raises:
        NotFoundError: no such sweep (or not the caller's).
        ConflictError: the sweep was cancelled (409).
        SpecValidationError: (422) an added trial is invalid; more than ``per_minute``.
        RateLimitedError: the added trials do not fit the rate limit now (429).
    """
    owner = caller.owner_filter
    with db.session() as session:
        # Concurrent extends would each plan the same new keys; the later ones would clash.
        crud.lock_sweep(session, sweep_id)
        sweep = crud.get_sweep(session, sweep_id, owner=owner)
        spec = extended_spec(SweepSpec.model_validate(sweep.spec), ext)
        keys, next_position = crud.trial_keys(session, sweep_id)
        planned = plan_trials(
            spec, settings, skip_keys=keys, first_position=next_position, stored=True
        )
        spec, planned = resolve_sweep_init_from(session, spec, planned, owner=owner)
        use_workspaces(session, sweep.owner, trial_workspaces(planned))
        check_jobs_rate(session, sweep.owner, per_minute=per_minute, jobs=len(planned))
        added = crud.extend_sweep(session, sweep, spec, planned)
        return _detail(session, sweep, added)


def get_sweep_curves(
    db: Database,
    sweep_id: int,
    name: str,
    *,
    owner: str | None,
    max_points: int,
    job_ids: Sequence[int] | None = None,
) -> list[TrialCurve]:
    """Metric ``name`` of each trial's current job, downsampled per trial to ``max_points``
    (``metrics.sweep_curves``: one query for all trials); trials without it left out;
    ``job_ids``: only the trials whose current job is one of these (None: all).

    Raises:
        NotFoundError: no such sweep (or not the owner's).
        ValueError: ``max_points`` below 4.
    """
    with db.session(write=False) as session:
        crud.get_sweep(session, sweep_id, owner=owner)
        return metrics.sweep_curves(session, sweep_id, name, max_points=max_points, job_ids=job_ids)


def list_sweep_metric_names(db: Database, sweep_id: int, *, owner: str | None) -> list[str]:
    """Every metric name any trial's current job reported, sorted.

    Raises:
        NotFoundError: no such sweep (or not the owner's).
    """
    with db.session(write=False) as session:
        crud.get_sweep(session, sweep_id, owner=owner)
        return metrics.sweep_metric_names(session, sweep_id)


def advance_sweeps(db: Database) -> list[str]:
    """Move running sweeps on (``progress.advance_sweeps``: max_failed, ASHA early
    stopping, end states); one line per thing done. A read first, so a deployment without
    running sweeps takes no write lock (SQLite)."""
    with db.session(write=False) as session:
        running = progress.has_running_sweeps(session)
    if not running:
        return []
    with db.session() as session:
        return progress.advance_sweeps(session)
