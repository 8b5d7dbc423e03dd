"""The metric ingest on PostgreSQL: one self-contained statement (``PG_RECORD``) that fences
the attempt, checks the quotas, inserts the points, adds them to their rollups and updates the
job. ``points.record_metrics`` runs it in a caller's session; the API's ingest runs it on the
driver's connection (``record_on_driver``, through ``Database.one_row``): for a batch of ~20
points the ORM session and SQLAlchemy's execution layer cost as much CPU as the rest of the
request, and the statement needs neither.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple

from sqlalchemy import column, text
from sqlalchemy.dialects.postgresql import psycopg as pg_psycopg
from sqlalchemy.sql.elements import TextClause
from sqlalchemy.sql.selectable import TextualSelect

from service.core.metrics.points import json_safe
from service.core.owners.quotas import MetricQuotas
from service.core.states import ACTIVE_STATES
from service.core.wire.metric_columns import CheckedColumns
from service.store.db import Database
from service.store.metrics.quotas import (
    latest_metrics,
    names_stored,
    quota_refusal,
    window_start,
)
from service.store.metrics.rollups import PG_ROLLUP_CTE
from service.store.models import utcnow
from service.store.workers.leases import fence_attempt

if TYPE_CHECKING:
    from service.store.loop_pool import LoopPool

# What ``quotas=None`` means: no bound a job could reach.
NO_LIMITS = MetricQuotas(max_names=2**62, per_minute=2**62)

_ACTIVE = frozenset(s.value for s in ACTIVE_STATES)
# The active states as an SQL array literal written into ``PG_RECORD``: fixed names, so a
# parameter (and psycopg dumping a list for every batch) buys nothing.
assert all(re.fullmatch("[a-z_]+", s) for s in _ACTIVE)
_PG_ACTIVE = "ARRAY[" + ", ".join(f"'{s}'" for s in sorted(_ACTIVE)) + "]"


class RecordRow(NamedTuple):
    """``PG_RECORD``'s one row, named (``Database.one_row`` hands a plain tuple: naming it
    from the cursor's description cost more than this class per batch)."""

    attempt: int
    state: str
    inserted: int
    taken: bool
    stored_names: int
    new_names: int
    window_points: int
    metric_window_at: datetime | None


# A whole ``record_metrics`` in one statement, so it needs no transaction of its own
# (``Database.one_row`` runs it in autocommit). The CTE ``job`` takes the row lock that
# ``leases.check_attempt`` takes; the insert and the job update happen only while the attempt
# is current and active (``ok``), and the caller gets the fence columns back to raise the same
# errors as ``leases.check_attempt``. The batch travels as one JSON text array per column
# (names, steps, epochs, values, times, ranks), zipped back into rows by ``ROWS FROM``:
# json.dumps of a flat list is C, where psycopg dumped array parameters element by element
# (half the client CPU of a 1,000-point batch), a record per point cost a dict each, and
# SQLAlchemy would compile a 7-parameters-per-row VALUES list anew for every batch.
# ``latest_metrics`` is merged as in ``points._merge_latest``: a name's entry is replaced only
# by a later step (a repeated step keeps its first value, as the metrics table does). The
# points inserted go on into their rollup buckets (``rollups.PG_ROLLUP_CTE``) in the same
# statement.
PG_RECORD = text(
    "WITH job AS (SELECT attempt, state, latest_metrics, metric_window_at, metric_window_points "
    "FROM jobs WHERE id = :job_id FOR UPDATE), "
    # The quotas, read from the locked row: names stored (latest_metrics holds one entry per
    # name with a current point) and new in this batch, and the points of the current window.
    "lm AS (SELECT CASE WHEN json_typeof(job.latest_metrics) = 'object' "
    "THEN job.latest_metrics::jsonb ELSE '{}'::jsonb END AS m, "
    "CASE WHEN job.metric_window_at > :window_start "
    "THEN COALESCE(job.metric_window_points, 0) ELSE 0 END AS window_points FROM job), "
    "room AS (SELECT (SELECT count(*) FROM jsonb_object_keys(lm.m)) AS stored_names, "
    "(SELECT count(*) FROM json_array_elements_text(CAST(:names AS json)) AS n(name) "
    "WHERE NOT jsonb_exists(lm.m, n.name)) AS new_names, lm.window_points FROM lm), "
    "ok AS (SELECT FROM job, room WHERE job.attempt = :attempt "
    "AND job.state = ANY(" + _PG_ACTIVE + ") "
    "AND (room.new_names = 0 OR room.stored_names + room.new_names <= :max_names) "
    "AND (:n = 0 OR room.window_points + :n <= :per_minute)), "
    "ins AS (INSERT INTO metrics (job_id, name, step, attempt, epoch, value, time, ranks) "
    "SELECT :job_id, u.n, u.s::bigint, :attempt, u.e::integer, u.v::float8, u.t::timestamptz, "
    "u.r::smallint FROM ROWS FROM (json_array_elements_text(CAST(:p_names AS json)), "
    "json_array_elements_text(CAST(:p_steps AS json)), "
    "json_array_elements_text(CAST(:p_epochs AS json)), "
    "json_array_elements_text(CAST(:p_values AS json)), "
    "json_array_elements_text(CAST(:p_times AS json)), "
    "json_array_elements_text(CAST(:p_ranks AS json))) AS u(n, s, e, v, t, r) "
    "WHERE EXISTS (SELECT FROM ok) "
    "ON CONFLICT DO NOTHING RETURNING name, step, value), " + PG_ROLLUP_CTE + ", "
    "upd AS (UPDATE jobs SET updated_at = :now, "
    "progress = CASE WHEN :set_progress THEN CAST(:progress AS json) ELSE jobs.progress END, "
    "metric_window_at = CASE WHEN jobs.metric_window_at > :window_start "
    "THEN jobs.metric_window_at ELSE :now END, "
    "metric_window_points = (SELECT window_points FROM room) + (SELECT count(*) FROM ins), "
    "latest_metrics = ((SELECT m FROM lm) || COALESCE((SELECT jsonb_object_agg(n.key, n.value) "
    "FROM lm, jsonb_each(CAST(:newest AS jsonb)) AS n "
    "WHERE COALESCE((lm.m->n.key->>'step')::bigint, -1) < (n.value->>'step')::bigint), "
    "'{}'))::json "
    "WHERE jobs.id = :job_id AND EXISTS (SELECT FROM ok)) "
    "SELECT job.attempt, job.state, (SELECT count(*) FROM ins) AS inserted, "
    "EXISTS (SELECT FROM ok) AS taken, room.stored_names, room.new_names, room.window_points, "
    "job.metric_window_at FROM job, room"
).columns(
    # Declared, so SQLAlchemy keeps the result's column map with the compiled statement
    # instead of building it from the cursor's description on every batch.
    *(column(c) for c in RecordRow._fields)
)


def _columns_params(cols: CheckedColumns) -> dict[str, str]:
    """Checked columns as the JSON text parameters ``PG_RECORD`` reads (``p_names`` …
    ``p_ranks``): NaN → null, ±inf → "±Infinity" (PostgreSQL's float8 input reads both),
    times as ISO 8601 UTC (a point without one gets now)."""
    now = utcnow()
    iso: dict[datetime, str] = {}  # a flush may stamp many points alike: format each once
    times = []
    for at in cols.times:
        at = at or now
        text_at = iso.get(at)
        if text_at is None:
            text_at = iso[at] = at.isoformat()
        times.append(text_at)
    values: list[Any] = cols.values
    if not math.isfinite(sum(values)):  # a NaN or an infinity somewhere: spell those out
        values = [json_safe(v) for v in values]
    dumps = json.dumps
    return {
        "p_names": dumps(cols.names),
        "p_steps": dumps(cols.steps),
        "p_epochs": dumps(cols.epochs),
        "p_values": dumps(values, allow_nan=False),
        "p_times": dumps(times),
        "p_ranks": dumps(cols.ranks),
    }


@dataclass(frozen=True, slots=True)
class IngestBatch:
    """One batch for ``PG_RECORD``: ``cols`` of job ``job_id``'s ``attempt``, each name's
    ``newest`` entry (``latest_metrics`` form, ``points.newest_entries``), the progress
    snapshot or None, and the job's metric quotas."""

    job_id: int
    attempt: int
    cols: CheckedColumns
    newest: dict[str, dict[str, Any]]
    progress: dict[str, Any] | None
    limits: MetricQuotas


def params(batch: IngestBatch, now: datetime) -> dict[str, Any]:
    """``PG_RECORD``'s parameters for ``batch`` at ``now`` (UTC)."""
    progress = batch.progress
    return {
        "job_id": batch.job_id,
        "attempt": batch.attempt,
        **_columns_params(batch.cols),
        "now": now,
        "set_progress": progress is not None,
        "progress": json.dumps(json_progress(progress)) if progress is not None else None,
        "newest": json.dumps(batch.newest),
        "names": json.dumps(list(batch.newest)),
        "n": len(batch.cols),
        "max_names": batch.limits.max_names,
        "per_minute": batch.limits.per_minute,
        "window_start": window_start(now),
    }


def json_progress(progress: dict[str, Any]) -> dict[str, Any]:
    """``progress`` with NaN/inf spelled as JSON can hold them (e.g. ``samples_per_s`` at a
    zero interval): PostgreSQL's json refuses them."""
    return {k: json_safe(v) if isinstance(v, float) else v for k, v in progress.items()}


def outcome(
    row: Any, batch: IngestBatch, now: datetime, stored_of_batch: Callable[[], Iterable[str]]
) -> int:
    """The points ``PG_RECORD``'s result ``row`` (None: no such job) for ``batch`` at ``now``
    says were inserted.

    Raises:
        NotFoundError / StaleAttemptError: the fence refused (``leases.fence_attempt``).
        QuotaExceededError: a quota refused the batch (nothing stored); ``stored_of_batch``
            gives the batch's names the job already has, for the name quota's refusal.
    """
    row = fence_attempt(batch.job_id, batch.attempt, row)
    if not row.taken:
        refusal = quota_refusal(
            batch.limits, stored_names=int(row.stored_names), new_names=int(row.new_names),
            window_points=int(row.window_points), window_at=row.metric_window_at,
            n=len(batch.cols), now=now, stored_of_batch=stored_of_batch,
        )  # fmt: skip
        assert refusal is not None  # the fence passed: only a quota refuses
        raise refusal
    return int(row.inserted)


@functools.cache
def _driver_sql(statement: TextClause | TextualSelect) -> str:
    """``statement`` as psycopg takes it (``%(name)s`` placeholders, ``%`` doubled)."""
    return str(statement.compile(dialect=pg_psycopg.dialect()))


async def record_on_loop(pool: LoopPool, batch: IngestBatch) -> int | None:
    """``PG_RECORD`` for ``batch`` awaited on the event loop (``loop_pool.LoopPool``): the
    points inserted when the statement took the batch; None when it did not run or did
    not take it (the fence or a quota refused: nothing stored), for the caller to do it
    again through ``record_on_driver``, which raises the refusal's error."""
    row = await pool.one_row(_driver_sql(PG_RECORD), params(batch, utcnow()))
    if row is None:
        return None
    result = RecordRow._make(row)
    return int(result.inserted) if result.taken else None


def record_on_driver(db: Database, batch: IngestBatch) -> int:
    """``points.record_metrics`` for checked columns on PostgreSQL, as one autocommit
    statement on the driver's connection (``Database.one_row``). The number of points
    inserted.

    Raises:
        NotFoundError / StaleAttemptError / QuotaExceededError: see ``outcome``.
        DatabaseUnavailableError / ConflictError: see ``Database.one_row``.
    """
    now = utcnow()
    row = db.one_row(_driver_sql(PG_RECORD), params(batch, now))
    if row is not None:
        row = RecordRow._make(row)

    def stored_of_batch() -> list[str]:
        with db.session(write=False) as session:
            return names_stored(latest_metrics(session, batch.job_id), batch.newest)

    return outcome(row, batch, now, stored_of_batch)
