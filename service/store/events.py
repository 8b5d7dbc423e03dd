"""The one writer of ``job_events``: every row gets its ``kind``, its ``data`` (JSON-safe) and
the ``reason`` rendered from them by ``service.core.events`` — one ORM row, a bulk insert, or
the claim's Core statements (whose event is part of the claim's single statement on
PostgreSQL). Plus the reads by kind that other modules need (never by text).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import String, Table, bindparam, insert, select
from sqlalchemy.orm import Session

from service.core.events import EventKind, json_safe, render
from service.core.states import JobState
from service.store.models import JobEvent, UTCDateTime, utcnow


def event_values(
    job_id: int,
    attempt: int,
    kind: EventKind,
    data: Mapping[str, Any] | None = None,
    *,
    from_state: str | None,
    to_state: str,
    worker_id: str | None = None,
    created_at: datetime | None = None,
) -> dict[str, Any]:
    """The column values of one ``job_events`` row (for ``record_events``' bulk insert).

    Args:
        kind: what happened; ``data`` holds the fields its wording names
            (``service.core.events.WORDING``).
        from_state, to_state: the job's states (``JobState`` values); equal for a note,
            ``from_state`` None for a submission.
        created_at: defaults to now.
    Raises:
        KeyError: ``data`` lacks a field the kind's wording needs.
    """
    safe = json_safe(data)
    return {
        "job_id": job_id,
        "attempt": attempt,
        "from_state": None if from_state is None else str(from_state),
        "to_state": str(to_state),
        "kind": EventKind(kind).value,
        "data": safe,
        "reason": render(kind, safe),
        "worker_id": worker_id,
        "created_at": created_at if created_at is not None else utcnow(),
    }


def record_event(
    session: Session,
    job_id: int,
    attempt: int,
    kind: EventKind,
    data: Mapping[str, Any] | None = None,
    *,
    from_state: str | None,
    to_state: str,
    worker_id: str | None = None,
) -> JobEvent:
    """Add one event of ``kind`` to the session (written with the caller's transaction);
    arguments as ``event_values``. For a note pass the job's state as both states."""
    event = JobEvent(
        **event_values(
            job_id, attempt, kind, data, from_state=from_state, to_state=to_state,
            worker_id=worker_id,
        )
    )  # fmt: skip
    session.add(event)
    return event


def record_events(session: Session, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert many rows made by ``event_values`` in one ``executemany``."""
    if rows:
        # On the table, not the ORM entity: the ORM's bulk INSERT cost ~200 Python calls
        # more per worker transition, for rows that are plain dicts either way.
        table: Table = JobEvent.__table__  # type: ignore[assignment]
        session.execute(insert(table), list(rows))


# -- the claim's event, as Core statements with bound parameters ------------------------------

# Parameters: ``claim_worker_id``, ``claim_now`` (and, for ``CLAIM_EVENT``, ``claim_job_id``
# and ``claim_attempt``). ``data`` is left to its server default (``{}``).
CLAIM_EVENT_VALUES: dict[str, Any] = {
    "from_state": bindparam("claim_from_state", JobState.QUEUED.value, type_=String()),
    "to_state": bindparam("claim_to_state", JobState.STARTING.value, type_=String()),
    "kind": bindparam("claim_kind", EventKind.CLAIMED.value, type_=String()),
    "reason": bindparam("claim_reason", render(EventKind.CLAIMED), type_=String()),
    "worker_id": bindparam("claim_worker_id", type_=String()),
    "created_at": bindparam("claim_now", type_=UTCDateTime()),
}

# The ``claimed`` event of one job (``claim_job_id``, ``claim_attempt``): SQLite's claim
# writes it after its UPDATE.
CLAIM_EVENT = insert(JobEvent).values(
    job_id=bindparam("claim_job_id"), attempt=bindparam("claim_attempt"), **CLAIM_EVENT_VALUES
)


def claim_events_from(claimed: Any) -> Any:
    """A data-modifying CTE (``claim_events``) inserting one ``claimed`` event per row of
    ``claimed`` (the claim UPDATE's ``RETURNING`` CTE, with ``id`` and ``attempt`` columns):
    the event half of PostgreSQL's one-statement claim."""
    return (
        insert(JobEvent)
        .from_select(
            ["job_id", "attempt", *CLAIM_EVENT_VALUES],
            select(claimed.c.id, claimed.c.attempt, *CLAIM_EVENT_VALUES.values()),
        )
        .cte("claim_events")
    )


# -- reads by kind -----------------------------------------------------------------------------


def newest_event(session: Session, job_id: int, attempt: int, kind: EventKind) -> JobEvent | None:
    """The newest event of ``kind`` of the job's ``attempt``; None when there is none."""
    return session.scalars(
        select(JobEvent)
        .where(JobEvent.job_id == job_id, JobEvent.kind == kind.value, JobEvent.attempt == attempt)
        .order_by(JobEvent.id.desc())
        .limit(1)
    ).one_or_none()


def events_of_kinds(
    session: Session, job_id: int, attempt: int, kinds: Iterable[EventKind]
) -> list[JobEvent]:
    """The job's ``attempt``'s events of any of ``kinds``, oldest first."""
    return list(
        session.scalars(
            select(JobEvent)
            .where(
                JobEvent.job_id == job_id,
                JobEvent.kind.in_([k.value for k in kinds]),
                JobEvent.attempt == attempt,
            )
            .order_by(JobEvent.id)
        )
    )
