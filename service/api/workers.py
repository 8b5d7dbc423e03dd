"""Route of the worker resource: every worker, its heartbeat age and the jobs it holds."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import DbDep
from service.api.schemas import WorkerListOut, worker_out
from service.workers import list_workers

router = APIRouter(tags=["workers"])


@router.get("/workers", response_model=WorkerListOut, summary="Workers and their heartbeats")
def workers_route(db: DbDep) -> WorkerListOut:
    """Every worker, newest heartbeat first, with the ids of the active jobs it holds."""
    with db.session(write=False) as session:
        return WorkerListOut(workers=[worker_out(w, jobs) for w, jobs in list_workers(session)])
