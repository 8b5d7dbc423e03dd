"""Route of the worker resource: every worker, its heartbeat age and the jobs it holds.

Any authenticated caller sees every worker (hosts, capacity, heartbeats: what they need to
see why their job waits); the ids of held jobs are filtered to the caller's own unless the
caller is an admin, so other owners' job ids do not leak.
"""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import REQUIRE_CALLER, UNAUTHORIZED, ContextDep
from service.api.schemas import WorkerListOut, worker_out
from service.store.jobs.crud import owned_job_ids
from service.store.workers.registry import list_workers

router = APIRouter(tags=["workers"], dependencies=[REQUIRE_CALLER], responses=UNAUTHORIZED)


@router.get("/workers", response_model=WorkerListOut, summary="Workers and their heartbeats")
def workers_route(ctx: ContextDep) -> WorkerListOut:
    """Every worker, newest heartbeat first, with the ids of the active jobs it holds (only
    the caller's own jobs unless the caller is an admin)."""
    with ctx.db.session(write=False) as session:
        rows = list_workers(session)
        if ctx.owner is not None:
            mine = owned_job_ids(session, [j for _, held in rows for j in held], ctx.owner)
            rows = [(w, [j for j in held if j in mine]) for w, held in rows]
        return WorkerListOut(workers=[worker_out(w, held) for w, held in rows])
