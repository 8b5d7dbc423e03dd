"""The attempt API: what a job's rank 0 writes while its attempt runs (metric batches and
progress, its timeline) and reads back (its own identity), and the helpers every attempt
router shares (body parsing, the thread hop). Checkpoint records and the list for resume are
``checkpoints``; uploads ``uploads``; downloads ``downloads``; notes ``notes``. Each route is
one call of a use case (``service.store.{attempts,metrics,checkpoints}.service``), which
checks the fence in its own transaction.

Who may call it: only a holder of an attempt token (``Authorization: Bearer ddpqa_…``,
minted by the worker at launch; ``deps.get_attempt``), whether the server's auth is on or
off. An API token, a user, an admin: 401. No route takes a job id; the token names the job
and attempt, so a rank can touch nothing but its own job, and only while its attempt is the
job's current, active one (the fence, checked in the statement that writes): else 409 with a
``detail`` starting ``attempt superseded``, and the rank stops.

The wire format (paths, payloads) is ``service.core.wire.attempt``, shared with the rank's
client.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from service.api.deps import (
    ATTEMPT_SECURITY,
    ATTEMPT_UNAUTHORIZED,
    REQUIRE_ATTEMPT,
    AttemptDep,
    attempt_of,
)
from service.api.files import checkpoint_stores
from service.core.errors import DdpqError
from service.core.metrics.points import CheckedPoint, MetricPoint, checked_point
from service.core.owners.quotas import MetricQuotas
from service.core.wire import attempt as wire
from service.core.wire.metric_columns import (
    CheckedColumns,
    checked_columns,
    columns_of_points,
    joined,
)
from service.store.attempts import service as attempts
from service.store.attempts.values import AttemptRef, TimelineUpdate
from service.store.db import Database
from service.store.metrics import service as metrics

# Seconds a rank waits before it sends a batch refused for back-pressure again.
RETRY_AFTER_S = 1
# A metric body up to this many bytes (~500 points) is parsed and checked on the event loop
# when its statement runs there too (``Database.loop_pool``): that costs less than the hop
# to a thread and back. A bigger one (up to ``MAX_BATCH_ROWS`` points) would hold the loop
# for milliseconds, so it goes to a thread whole.
ON_LOOP_BODY_BYTES = 16 * 1024

ERRORS: dict[int | str, dict[str, Any]] = {
    **ATTEMPT_UNAUTHORIZED,
    409: {"description": "The attempt is no longer the job's current, active one: stop"},
    422: {"description": "A malformed body (unknown fields included)"},
}

router = APIRouter(tags=["attempts"], dependencies=[REQUIRE_ATTEMPT], responses=ERRORS)
# The metric ingest alone, without the router-wide dependency: its route checks the token
# itself (``deps.attempt_of``), so it solves no dependency. A plain batch reaches the route
# function straight from ``direct_ingest.DirectIngest``; the app includes this router before
# all others for the rest (a chunked body), and for the OpenAPI document.
ingest_router = APIRouter(tags=["attempts"], responses=ERRORS)


class AttemptInputError(DdpqError):
    """A well-formed attempt request whose content cannot be accepted before it reaches a use
    case (e.g. a chunk whose declared ``Content-Length`` exceeds ``chunk_bytes``)."""

    status_code = 422
    code = "invalid_attempt_input"


# -- back-pressure ---------------------------------------------------------------------------


@dataclass
class IngestLimiter:
    """How many metric batches this app writes at once, at most ``limit``.

    Entered and left only on the event loop's thread (the routes are ``async``), so a plain
    counter needs no lock.
    """

    limit: int
    busy: int = 0

    def try_enter(self) -> bool:
        """Take a slot; False (take nothing) when all ``limit`` are busy."""
        if self.busy >= self.limit:
            return False
        self.busy += 1
        return True

    def leave(self) -> None:
        """Give a slot back."""
        self.busy = max(0, self.busy - 1)


def metric_quotas(app: FastAPI) -> MetricQuotas:
    """The app's metric quotas (``DDPQ_METRIC_NAMES_PER_JOB``,
    ``DDPQ_METRIC_POINTS_PER_MINUTE``)."""
    return MetricQuotas.from_settings(app.state.settings)


def ingest_limiter(app: FastAPI) -> IngestLimiter:
    """The app's limiter, built on first use from ``settings.attempt_ingest_concurrency``
    (per process: each API process writes up to that many batches at once)."""
    limiter: IngestLimiter | None = getattr(app.state, "attempt_ingest_limiter", None)
    if limiter is None:
        limiter = IngestLimiter(app.state.settings.attempt_ingest_concurrency)
        app.state.attempt_ingest_limiter = limiter
    return limiter


# -- helpers ----------------------------------------------------------------------------------


async def _in_thread(fn: Any, *args: Any) -> Any:
    # The loop's default executor, as get_job_route does: cheaper than anyio's thread hop.
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


BodyT = TypeVar("BodyT", bound=BaseModel)


def _json_body(model: type[BodyT]) -> Any:
    """A dependency that reads the request body as ``model``: any body that is not one —
    invalid JSON, bytes that are not UTF-8 — is a 422 (FastAPI's own body parsing answers
    400 to undecodable bytes). Pair it with ``_body_doc(model)`` for the OpenAPI document."""

    async def parse(request: Request) -> BodyT:
        try:
            return model.model_validate_json(await request.body())
        except ValidationError as exc:
            raise RequestValidationError(
                exc.errors(include_url=False, include_context=False, include_input=False)
            ) from None

    return Depends(parse)


def _body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI ``requestBody`` of a route whose body ``_json_body`` reads."""
    schema = model.model_json_schema()
    content = {"application/json": {"schema": schema}}
    return {"requestBody": {"required": True, "content": content}}


def _db(request: Request) -> Database:
    db: Database = request.app.state.db
    return db


def _checked_rows(rows: list[wire.MetricRow]) -> tuple[list[CheckedPoint], list[str]]:
    """Wire rows as checked points, and why each other row was refused (``row <i>: …``)."""
    good: list[CheckedPoint] = []
    refused: list[str] = []
    for i, row in enumerate(rows):
        name, step, epoch, value, time_s = row[:5]
        ranks = row[5] if len(row) > 5 else None
        try:
            at = datetime.fromtimestamp(time_s, UTC)
            point = MetricPoint(name, step, wire.decode_value(value), epoch, at, ranks)
            good.append(checked_point(point))
        except (ValueError, OverflowError, OSError) as exc:  # OSError: a time out of range
            refused.append(f"row {i}: {exc}")
    return good, refused


def _progress(raw: dict[str, Any] | None) -> dict[str, Any] | None:
    """The stored keys of a progress snapshot with a number or null each; others dropped."""
    if raw is None:
        return None
    return {
        k: v
        for k in wire.PROGRESS_KEYS
        if (v := raw.get(k)) is None or (isinstance(v, int | float) and not isinstance(v, bool))
    }


# -- routes -----------------------------------------------------------------------------------


@router.get(wire.SELF_PATH, response_model=wire.AttemptSelf, summary="The token's attempt")
async def self_route(request: Request, ref: AttemptDep) -> wire.AttemptSelf:
    """Which job and attempt the token stands for, while that attempt is current and active;
    the filesystem store's id (``store_id``: a rank whose artifact root holds the same id
    shares the API's filesystem, any other uploads) and the job's resolved ``init_from``.

    Caller: a rank holding the attempt token (nobody else). Raises 409 ``attempt superseded``
    once the job was requeued, cancelled or finished.
    """

    def read() -> wire.AttemptSelf:
        info = attempts.describe_attempt(
            _db(request),
            checkpoint_stores(request.app),
            ref,
            upload_store=request.app.state.settings.checkpoint_store,
        )
        init = info.init_from
        return wire.AttemptSelf(
            job_id=info.job_id,
            attempt=info.attempt,
            state=info.state.value,
            store_id=info.store_id,
            init_from=wire.InitFrom(**asdict(init)) if init is not None else None,
        )

    result: wire.AttemptSelf = await _in_thread(read)
    return result


@ingest_router.post(
    wire.METRICS_PATH,
    response_model=wire.MetricBatchAck,
    summary="Append metric points and progress",
    responses={
        422: {
            "description": "A malformed body, or a batch that would bring the job past "
            "DDPQ_METRIC_NAMES_PER_JOB names (nothing of it stored)"
        },
        429: {
            "description": "Too many batches in flight, or the job's points this minute are at "
            "DDPQ_METRIC_POINTS_PER_MINUTE: send it again after `Retry-After` seconds"
        },
    },
    openapi_extra={**_body_doc(wire.MetricBatch), "security": ATTEMPT_SECURITY},
)
async def metrics_route(request: Request) -> Response:
    """Store a batch of points (``MetricSeries`` columns, or ``[name, step, epoch, value,
    time_s]`` rows from older ranks) and, when given, the job's progress snapshot, in one
    fenced statement. Idempotent per (job, name, step):
    a resent batch inserts 0. A bad row is refused on its own (``refused``), the rest lands.

    Caller: a rank holding the attempt token (nobody else). Raises 409 ``attempt
    superseded`` when the attempt is no longer current (nothing stored), 422 for a body that
    is not a ``MetricBatch`` or that would bring the job past ``metric_names_per_job``
    names, 429 with ``Retry-After`` (seconds) when this process already writes
    ``attempt_ingest_concurrency`` batches or the job stored ``metric_points_per_minute``
    points in its current minute. A refused batch stores nothing; a quota's refusal is a
    ``quota_exceeded`` event on the job.
    """
    ref = await attempt_of(request)
    body = await request.body()
    limiter = ingest_limiter(request.app)
    if not limiter.try_enter():
        raise HTTPException(
            429,
            "too many metric batches in flight: send this one again later",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    try:
        db, quotas = _db(request), metric_quotas(request.app)
        if db.loop_pool is not None and len(body) <= ON_LOOP_BODY_BYTES:
            checked = _checked_batch(body)
            inserted = await metrics.record_columns_on_loop(
                db, ref, checked.columns, progress=checked.progress, quotas=quotas
            )
            if inserted is None:  # not taken there: stored, or refused, the usual way
                inserted = await _in_thread(_record, db, ref, checked, quotas)
            ack = checked.ack(inserted)
        else:
            ack = await _in_thread(_write_batch, db, ref, body, quotas)
    finally:
        limiter.leave()
    # Serialised here: a returned model would be validated once more by FastAPI.
    return Response(ack.model_dump_json(), media_type="application/json")


@dataclass(frozen=True, slots=True)
class _CheckedBatch:
    """A batch's storable points, why each other one was refused, and its progress."""

    columns: CheckedColumns
    refused: list[str]
    progress: dict[str, Any] | None

    def ack(self, inserted: int) -> wire.MetricBatchAck:
        return wire.MetricBatchAck(accepted=len(self.columns), inserted=inserted,
                                   refused=self.refused)  # fmt: skip


def _checked_batch(body: bytes) -> _CheckedBatch:
    """Parse and check one batch (CPU only).

    Raises:
        RequestValidationError: not a ``MetricBatch`` (422).
    """
    try:
        batch = wire.MetricBatch.model_validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    parts: list[CheckedColumns] = []
    refused: list[str] = []
    if batch.points:  # rows, as older ranks send them
        points, refused = _checked_rows(batch.points)
        parts.append(columns_of_points(points))
    if batch.series or not parts:
        columns, refused_points = checked_columns(batch.series)
        parts.append(columns)
        refused += refused_points
    return _CheckedBatch(joined(parts), refused, _progress(batch.progress))


def _record(db: Database, ref: AttemptRef, checked: _CheckedBatch, quotas: MetricQuotas) -> int:
    """Store a checked batch (blocking: in a worker thread); the points inserted.

    Raises:
        StaleAttemptError: the attempt is superseded (409).
        QuotaExceededError: over a metric quota (422 names, 429 rate; nothing stored).
    """
    return metrics.record_batch(db, ref, checked.columns, progress=checked.progress, quotas=quotas)


def _write_batch(
    db: Database, ref: AttemptRef, body: bytes, quotas: MetricQuotas
) -> wire.MetricBatchAck:
    """Parse, check and write one batch (in a worker thread: all of it is CPU or I/O).

    Raises: as ``_checked_batch`` and ``_record``.
    """
    checked = _checked_batch(body)
    return checked.ack(_record(db, ref, checked, quotas))


@router.post(
    wire.TIMELINE_PATH,
    status_code=204,
    response_class=Response,
    summary="Tell the attempt's resume step and costs",
    openapi_extra=_body_doc(wire.AttemptTimeline),
)
def timeline_route(
    request: Request,
    ref: AttemptDep,
    timeline: Annotated[wire.AttemptTimeline, _json_body(wire.AttemptTimeline)],
) -> Response:
    """Store what rank 0 measured about its attempt (``AttemptTimeline``). The first
    ``resume_step`` told moves earlier attempts' points of later steps aside as superseded
    (still readable with ``GET /jobs/{id}/metrics?include_superseded=true``), so the steps
    this attempt trains again are stored with its own values.

    Caller: a rank holding the attempt token (nobody else); 409 ``attempt superseded`` when
    the attempt is not current (nothing stored), 422 for a body that is not an
    ``AttemptTimeline``.
    """
    started = timeline.training_started_at_s
    update = TimelineUpdate(
        resume_step=timeline.resume_step,
        restore_s=timeline.restore_s,
        training_started_at=datetime.fromtimestamp(started, UTC) if started is not None else None,
        checkpoint_stall_s=timeline.checkpoint_stall_s,
        checkpoint_saves=timeline.checkpoint_saves,
    )
    attempts.record_timeline(_db(request), ref, update)
    return Response(status_code=204)
