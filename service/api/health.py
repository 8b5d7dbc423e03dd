"""Liveness and readiness: /healthz (process up), /readyz (database reachable, schema at head,
and the deployment's own worker registered when it starts one: ``Settings.expect_worker``)."""

from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from service.api.deps import REQUIRE_CALLER, UNAUTHORIZED, DbDep, SettingsDep
from service.api.errors import error_body
from service.api.schemas import HealthOut
from service.core.errors import DdpqError
from service.store.migrate import check_database
from service.store.workers import service as workers

log = logging.getLogger(__name__)

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthOut, summary="Liveness (no database access)")
def healthz() -> HealthOut:
    """200 while the process serves requests."""
    return HealthOut(status="ok")


@router.get(
    "/readyz",
    response_model=HealthOut,
    summary="Readiness: database reachable and schema at head",
    responses={
        503: {"description": "Not ready; `detail` says why and how to fix it"},
        **UNAUTHORIZED,
    },
    dependencies=[REQUIRE_CALLER],  # its detail names the schema revision: callers only
)
def readyz(db: DbDep, settings: SettingsDep) -> HealthOut | JSONResponse:
    """200 when the database answers and is migrated to head and, where the deployment starts
    its own worker (``ddpq up``), that worker is registered: a job submitted once this
    answers 200 has a worker. 503 with the reason otherwise (the database password never
    appears in it)."""
    try:
        check_database(db)
        launcher = settings.expect_worker
        if launcher is not None and not workers.has_live_worker(
            db, launcher=launcher, heartbeat_interval_s=settings.heartbeat_interval_s
        ):
            return JSONResponse(
                {"detail": f"waiting for the {launcher} worker to register"}, status_code=503
            )
    except DdpqError as err:
        detail = db.scrubbed(str(err.detail))
        log.warning("not ready: %s", detail)
        return JSONResponse(error_body(detail, err.code), status_code=503)
    return HealthOut(status="ok")
