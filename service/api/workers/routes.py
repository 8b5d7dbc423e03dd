"""Route of the worker resource: every worker, its heartbeat age and the jobs it holds.

Any authenticated caller sees every worker (hosts, capacity, heartbeats: what they need to
see why their job waits); the ids of held jobs are filtered to the caller's own unless the
caller is an admin, so other owners' job ids do not leak.
"""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import REQUIRE_CALLER, UNAUTHORIZED, ContextDep
from service.api.schemas import WorkerListOut, worker_out
from service.store.workers import service as workers

router = APIRouter(tags=["workers"], dependencies=[REQUIRE_CALLER], responses=UNAUTHORIZED)


@router.get("/workers", response_model=WorkerListOut, summary="Workers and their heartbeats")
def workers_route(ctx: ContextDep) -> WorkerListOut:
    """Every worker, newest heartbeat first, with its status (``live``, ``lost``: the API no
    longer hears from it, ``stopped``) and the ids of the active jobs it holds (only the
    caller's own jobs unless the caller is an admin). Caller: any user token (auth on) or
    anyone (auth off); a worker's or a rank's token gets 401."""
    found = workers.list_workers(
        ctx.db, owner=ctx.owner, heartbeat_interval_s=ctx.settings.heartbeat_interval_s
    )
    return WorkerListOut(workers=[worker_out(w) for w in found])
