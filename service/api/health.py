"""Liveness and readiness: /healthz (process up), /readyz (database reachable, schema at head)."""

from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import exc as sa_exc
from sqlalchemy import text
from sqlalchemy.engine import make_url

from service.api.deps import REQUIRE_CALLER, UNAUTHORIZED, DbDep
from service.api.schemas import HealthOut
from service.core.errors import DatabaseUnavailableError, DdpqError
from service.store import migrate
from service.store.db import Database

log = logging.getLogger(__name__)

router = APIRouter(tags=["health"])


def check_database(db: Database) -> None:
    """Raise unless the database answers and its schema is at the head revision.

    Raises:
        DatabaseUnavailableError: the database cannot be reached (503).
        SchemaOutOfDateError: not migrated to head; the message says to run `ddpq db upgrade`.
    """
    with db.session(write=False) as session:
        session.execute(text("SELECT 1"))
    try:
        migrate.check_at_head(db.engine)
    except sa_exc.SQLAlchemyError as exc:
        # The database went away between the two checks; same answer as the first one.
        raise DatabaseUnavailableError(f"database unavailable: {type(exc).__name__}") from exc


def scrub_password(message: str, url: str) -> str:
    """``message`` with the password of ``url`` (if any) replaced by ``***``."""
    try:
        password = make_url(url).password
    except sa_exc.ArgumentError:
        return message
    return message.replace(str(password), "***") if password else message


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
def readyz(db: DbDep) -> HealthOut | JSONResponse:
    """200 when the database answers and is migrated to head; 503 with the reason otherwise
    (the database password never appears in it)."""
    try:
        check_database(db)
    except DdpqError as err:
        url = db.engine.url.render_as_string(hide_password=False)
        detail = scrub_password(str(err.detail), url)
        log.warning("not ready: %s", detail)
        return JSONResponse({"detail": detail}, status_code=503)
    return HealthOut(status="ok")
