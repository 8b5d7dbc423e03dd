"""Routes of the worker API (``/api/v1/workers/self/…``, ``service.core.wire.worker``): what a
worker does with its own row and the jobs it holds, and nothing more.

Caller: a worker token only (``ddpq token create --worker``), whether auth is on or off, with
the worker's id in the ``Ddpq-Worker-Id`` header (``deps.get_worker``). A user or attempt
token gets 401, as does a revoked worker token. A worker id registered with another worker
token gets 403 on every route. Every write on a job is fenced on the calling worker holding
it (404 ``job_not_held`` or 409 ``stale_state`` otherwise), so one worker's token never moves
another worker's jobs, and it reads only the specs of jobs it claims.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from service.api.bodies import body_doc, json_body
from service.api.claim_waits import claim_waits
from service.api.deps import (
    REQUIRE_WORKER,
    WORKER_UNAUTHORIZED,
    SettingsDep,
    WorkerDep,
    forget_worker,
)
from service.api.http import ERRORS
from service.core.errors import NotFoundError, SpecValidationError, WorkerTokenMismatchError
from service.core.events import EventKind
from service.core.launchers import launcher_names
from service.core.wire.worker import (
    ADOPTER_PATH,
    ADOPTIONS_PATH,
    CLAIM_PATH,
    HANDLES_PATH,
    HEARTBEAT_PATH,
    NOTES_PATH,
    PENDING_PATH,
    REGISTER_PATH,
    STOP_PATH,
    TRANSITIONS_PATH,
    AdopterIn,
    AdopterOut,
    AdoptOut,
    ClaimIn,
    ClaimOut,
    HandlesIn,
    HeartbeatOut,
    NoteIn,
    NoteOut,
    PendingIn,
    RegisterIn,
    TransitionIn,
    TransitionOut,
    WorkerAck,
)
from service.store.db import Database
from service.store.workers import service as workers
from service.store.workers.values import WorkerCaller

router = APIRouter(
    tags=["worker API"], dependencies=[REQUIRE_WORKER], responses={**ERRORS, **WORKER_UNAUTHORIZED}
)


def _registered(caller: WorkerCaller) -> str:
    """The caller's launcher, once its id is registered with its own token.

    Raises:
        NotFoundError: the id has no row (register again: the worker's loop does).
        WorkerTokenMismatchError: another worker token registered the id.
    """
    if not caller.registered:
        raise NotFoundError(f"worker {caller.worker_id} is not registered: register first")
    if not caller.owns_row:
        raise WorkerTokenMismatchError(
            f"worker id {caller.worker_id} is registered with another worker token"
        )
    return caller.launcher or ""


def _db(request: Request) -> Database:
    db: Database = request.app.state.db
    return db


@router.put(
    REGISTER_PATH,
    response_model=WorkerAck,
    summary="Register (or revive) this worker",
    openapi_extra=body_doc(RegisterIn),
)
async def register(
    body: Annotated[RegisterIn, json_body(RegisterIn)],
    request: Request,
    caller: WorkerDep,
    settings: SettingsDep,
) -> WorkerAck:
    """Insert or revive the calling worker's row, bound to its token from now on; the answer
    gives the lease length the API grants (seconds). 422 for an unknown launcher."""
    if body.launcher not in launcher_names():
        raise SpecValidationError(
            [
                {
                    "loc": ["body", "launcher"],
                    "msg": f"unknown launcher {body.launcher!r}: one of {list(launcher_names())}",
                    "type": "value_error",
                }
            ]
        )
    await run_in_threadpool(
        lambda: workers.register_worker(
            _db(request), worker_id=caller.worker_id, host=body.host, pid=body.pid,
            launcher=body.launcher, capacity=body.capacity.model_dump(exclude_none=True),
            token_id=caller.token_id,
        )
    )  # fmt: skip
    forget_worker(request)  # its launcher may have changed
    return WorkerAck(worker_id=caller.worker_id, lease_s=settings.lease_s)


@router.post(HEARTBEAT_PATH, response_model=HeartbeatOut, summary="Renew this worker's leases")
async def heartbeat(request: Request, caller: WorkerDep, settings: SettingsDep) -> HeartbeatOut:
    """Stamp the worker alive and renew the leases of the jobs it holds (``lease_s`` seconds
    from now); the jobs it holds, each with its state and whether a cancel was requested.
    404 when the worker is not registered (register again); 401 when its token was revoked
    (checked in the heartbeat's transaction: no lease of a revoked token is renewed)."""
    _registered(caller)
    held = await run_in_threadpool(
        lambda: workers.record_heartbeat(
            _db(request), caller.worker_id, lease_s=settings.lease_s, token_id=caller.token_id
        )
    )
    return HeartbeatOut(jobs=held, lease_s=settings.lease_s)


@router.post(STOP_PATH, response_model=WorkerAck, summary="Mark this worker stopped")
async def stop(request: Request, caller: WorkerDep, settings: SettingsDep) -> WorkerAck:
    """A clean shutdown: the worker is marked stopped (its detached jobs become adoptable)."""
    _registered(caller)
    await run_in_threadpool(workers.stop_worker, _db(request), caller.worker_id)
    return WorkerAck(worker_id=caller.worker_id, lease_s=settings.lease_s)


@router.post(
    CLAIM_PATH,
    response_model=ClaimOut,
    summary="Claim jobs (a long poll)",
    openapi_extra=body_doc(ClaimIn),
)
async def claim(
    body: Annotated[ClaimIn, json_body(ClaimIn)],
    request: Request,
    caller: WorkerDep,
    settings: SettingsDep,
) -> ClaimOut:
    """Claim the next ``limit`` jobs this worker can run (or, with ``batch``, up to ``limit``
    trials of one sweep), each now ``starting``, leased to it, with its spec and a new
    attempt token for its ranks. With nothing claimable, wait up to ``wait_s`` seconds for a
    job to become claimable (a submission here wakes the claim at once; one in another API
    process, a requeue or a freed sweep slot within ``claim_waits.PROBE_S``), then answer
    with no job.
    The wait holds no database connection. A client that went away meanwhile claims nothing,
    and a worker token revoked meanwhile is 401 when a claim is tried (each try checks it in
    its transaction); a wait that ends with nothing tried answers no job, and the worker's
    next claim or heartbeat is refused."""
    launcher = _registered(caller)
    db = _db(request)
    waits = claim_waits(request.app)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + body.wait_s
    key = (launcher, body.max_gpus_per_node)
    woken = False
    if body.wait_s > 0 and waits.known_empty(key):  # nothing to claim a probe ago: wait
        if not await waits.wait(key, body.wait_s):
            return ClaimOut(jobs=[])
        woken = True
        if await request.is_disconnected():
            waits.pass_on(key)
            return ClaimOut(jobs=[])
    while True:
        # Each try re-checks the token in the claim's transaction: one revoked while this
        # request waited claims nothing (401).
        found = await run_in_threadpool(
            lambda: workers.claim_for_worker(
                db, worker_id=caller.worker_id, launcher=launcher,
                max_gpus_per_node=body.max_gpus_per_node, lease_s=settings.lease_s,
                batch_limit=body.limit if body.batch else None, token_id=caller.token_id,
                limit=1 if body.batch else body.limit,
            )
        )  # fmt: skip
        if found is not None:
            if woken:
                waits.pass_on(key)  # there may be more: the next waiting claim looks
            return ClaimOut(
                jobs=list(found.jobs), sweep_id=found.sweep_id, max_concurrent=found.max_concurrent
            )
        left = deadline - loop.time()
        if left <= 0 or await request.is_disconnected():
            return ClaimOut(jobs=[])
        if not await waits.wait(key, left):
            return ClaimOut(jobs=[])  # the wait ran out: the worker asks again anyway
        woken = True
        # A worker that hung up meanwhile (killed, or its client gave up) would never see a
        # job claimed now, which would sit starting in its name until the lease ran out.
        if await request.is_disconnected():
            waits.pass_on(key)
            return ClaimOut(jobs=[])


@router.post(
    TRANSITIONS_PATH,
    response_model=TransitionOut,
    summary="Change a held job's state",
    openapi_extra=body_doc(TransitionIn),
)
async def transition(
    body: Annotated[TransitionIn, json_body(TransitionIn)], request: Request, caller: WorkerDep
) -> TransitionOut:
    """Apply a state change to a job this worker holds: one compare-and-set on its state and
    holder, with its event (the failure reason in the event's data is what the retry policy
    reads). 409 ``stale_state`` when the job moved on or another worker holds it; 409
    ``invalid_transition`` for a change the transition table forbids."""
    _registered(caller)
    state = await run_in_threadpool(
        lambda: workers.apply_held_transition(
            _db(request), body.transition, worker_id=caller.worker_id, error=body.error,
            values=dict(body.values.items()),
        )
    )  # fmt: skip
    return TransitionOut(state=state)


@router.post(
    HANDLES_PATH,
    response_model=WorkerAck,
    summary="Record scheduler job ids",
    openapi_extra=body_doc(HandlesIn),
)
async def handles(
    body: Annotated[HandlesIn, json_body(HandlesIn)],
    request: Request,
    caller: WorkerDep,
    settings: SettingsDep,
) -> WorkerAck:
    """Store detached launchers' handles (Slurm job ids) as the ``scheduler_job_id`` of jobs
    this worker holds at those attempts; a handle of any other job is dropped."""
    _registered(caller)
    await run_in_threadpool(
        lambda: workers.record_held_handles(_db(request), body.handles, worker_id=caller.worker_id)
    )
    return WorkerAck(worker_id=caller.worker_id, lease_s=settings.lease_s)


@router.post(
    NOTES_PATH,
    response_model=NoteOut,
    summary="Add a note to a held job's events",
    openapi_extra=body_doc(NoteIn),
)
async def note(
    body: Annotated[NoteIn, json_body(NoteIn)], request: Request, caller: WorkerDep
) -> NoteOut:
    """A note (no state change) on the current attempt of a job this worker holds; 404
    ``job_not_held`` otherwise, 422 for data its kind's wording lacks."""
    _registered(caller)
    try:
        written = await run_in_threadpool(
            lambda: workers.note_held_job(
                _db(request), body.job_id, body.attempt, body.kind, body.data,
                worker_id=caller.worker_id,
            )
        )  # fmt: skip
    except KeyError as exc:
        loc = ["body", "data", str(exc.args[0]) if exc.args else "data"]
        raise SpecValidationError(
            [{"loc": loc, "msg": f"{body.kind.value} needs this field", "type": "missing"}]
        ) from None
    return NoteOut(written=written)


@router.post(
    PENDING_PATH,
    response_model=NoteOut,
    summary="Record a scheduler pending reason",
    openapi_extra=body_doc(PendingIn),
)
async def pending_reason(
    body: Annotated[PendingIn, json_body(PendingIn)], request: Request, caller: WorkerDep
) -> NoteOut:
    """The batch scheduler's pending reason for the current attempt of a job this worker
    holds, unless it is the newest one recorded (``written`` False then); 404 otherwise."""
    _registered(caller)
    written = await run_in_threadpool(
        lambda: workers.note_held_job(
            _db(request), body.job_id, body.attempt, EventKind.SCHEDULER_PENDING, {},
            worker_id=caller.worker_id, pending=(body.code, body.words),
        )
    )  # fmt: skip
    return NoteOut(written=written)


@router.post(ADOPTIONS_PATH, response_model=AdoptOut, summary="Adopt lost workers' Slurm jobs")
async def adopt(request: Request, caller: WorkerDep, settings: SettingsDep) -> AdoptOut:
    """Take over the detached jobs (submitted to Slurm) of lost or stopped workers of this
    worker's launcher; the jobs it now holds, to be followed by their ``scheduler_job_id``."""
    launcher = _registered(caller)
    adopted = await run_in_threadpool(
        lambda: workers.adopt_detached_jobs(
            _db(request), worker_id=caller.worker_id, launcher=launcher, lease_s=settings.lease_s
        )
    )
    return AdoptOut(jobs=adopted)


@router.post(
    ADOPTER_PATH,
    response_model=AdopterOut,
    summary="Who adopted a job's attempt",
    openapi_extra=body_doc(AdopterIn),
)
async def adopter(
    body: Annotated[AdopterIn, json_body(AdopterIn)], request: Request, caller: WorkerDep
) -> AdopterOut:
    """The other worker that adopted ``attempt`` of the job and still holds it, if any: a
    worker that lost a detached job then leaves it running instead of cancelling it."""
    _registered(caller)
    found = await run_in_threadpool(
        lambda: workers.find_adopter(
            _db(request), body.job_id, body.attempt, worker_id=caller.worker_id
        )
    )
    return AdopterOut(worker_id=found)
