"""create_app(settings): the FastAPI application — routers, error handling, body limit, lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.staticfiles import StaticFiles
from starlette.middleware.gzip import DEFAULT_EXCLUDED_CONTENT_TYPES

from service.api import docs, health
from service.api.attempts import checkpoints as attempt_checkpoints
from service.api.attempts import downloads as attempt_downloads
from service.api.attempts import notes as attempt_notes
from service.api.attempts import routes as attempts
from service.api.attempts import uploads as attempt_uploads
from service.api.attempts import workspace as attempt_workspace
from service.api.attempts.direct_ingest import DirectIngest
from service.api.checkpoints import routes as checkpoints
from service.api.claim_waits import ClaimWaits
from service.api.errors import install_error_handlers
from service.api.jobs import goodput, logs
from service.api.jobs import routes as jobs
from service.api.metrics import routes as metrics
from service.api.middleware import BodySizeLimit, ReadsGZip
from service.api.schemas import job_spec_openapi_schemas
from service.api.sweeps import metrics as sweep_metrics
from service.api.sweeps import routes as sweeps
from service.api.workers import routes as workers
from service.api.workers import self_routes as worker_self
from service.api.workspaces import routes as workspaces
from service.core.config import Settings, get_settings
from service.core.wire import API_PREFIX
from service.core.wire.attempt import UPLOAD_CHUNK_PATH
from service.core.wire.workspace import FILE_CHUNK_PATH, FILES_BATCH_PATH, WORKSPACES_PATH
from service.store.checkpoints.stores import make_stores
from service.store.db import Database, redact_url
from service.store.jobs.service import count_claimable_jobs
from service.store.migrate import check_database
from service.store.reaper import reap_forever
from service.store.workspaces.stores import make_workspace_stores
from service.web import routes as web_routes

log = logging.getLogger(__name__)


def _path_re(*paths: str) -> re.Pattern[str]:
    """A regex of the API paths ``paths``, each ``{upload_id}`` any number."""
    escaped = (re.escape(API_PREFIX + p).replace(re.escape("{upload_id}"), "[0-9]+") for p in paths)
    return re.compile("^(?:" + "|".join(escaped) + ")$")


# Chunk uploads (checkpoints, workspace files) and batches of small workspace files carry
# their own cap (the chunk cap), checked as they stream.
CHUNK_UPLOAD_PATH_RE = _path_re(UPLOAD_CHUNK_PATH, FILE_CHUNK_PATH, FILES_BATCH_PATH)
# POST /workspaces carries a whole manifest: up to workspace_max_files entries.
WORKSPACE_CREATE_PATH_RE = _path_re(WORKSPACES_PATH)
# Bytes of manifest JSON allowed per file (a long path included), above max_body_bytes.
MANIFEST_BODY_BYTES_PER_FILE = 512
STATIC_DIR = Path(__file__).resolve().parent / "web" / "static"
# Answers shorter than this (bytes) are sent uncompressed: ranks' and workers' acks, claims.
GZIP_MIN_BYTES = 1024


def _install_openapi(app: FastAPI) -> None:
    """Generate the OpenAPI document with JobSpec's schema (POST /jobs reads its body raw)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(job_spec_openapi_schemas())
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(settings: Settings | None = None) -> FastAPI:
    """The ddpq API (prefix /api/v1), the dashboard routes and /static.

    Builds the Database for ``settings`` (default: ``get_settings()``) without connecting;
    at startup the lifespan checks the database and refuses to start unless its schema is
    at head.

    Raises (at startup):
        SchemaOutOfDateError: the database is not migrated; run `ddpq db upgrade`.
        DatabaseUnavailableError: the database cannot be reached.
    """
    settings = settings or get_settings()
    db = Database.from_url(settings.resolved_database_url)
    stores = make_stores(settings, db)  # no I/O until a request or the reaper uses them
    workspace_stores = make_workspace_stores(settings, db)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        check_database(db)
        log.info("serving %s", redact_url(settings.resolved_database_url))
        # Everything imported and built so far lives as long as the process: keep it out of
        # the collector's full passes, each of which stalled a request by ~140 ms (124k
        # objects, 2-core box). Once per process (tests build many apps).
        if gc.get_freeze_count() == 0:
            gc.freeze()
        # Metric batches await their statement on this loop (PostgreSQL only).
        loop_pool = await db.open_loop_pool(settings.attempt_ingest_concurrency)
        reaper = asyncio.create_task(
            reap_forever(
                db,
                settings.heartbeat_interval_s,
                worker_retention_s=settings.worker_retention_s,
                checkpoint_stores=stores,
                upload_stale_s=settings.checkpoint_upload_stale_s,
                workspace_stores=workspace_stores,
                workspace_retention_days=settings.workspace_retention_days,
            )
        )
        try:
            yield
        finally:
            await app.state.claim_waits.close()
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
            try:
                await db.close_loop_pool(loop_pool)
            finally:
                db.dispose()

    app = FastAPI(
        title="ddpq",
        version="0.1.0",
        description="Job submission service for distributed PyTorch (DDP) training.",
        lifespan=lifespan,
        docs_url=None,  # service.api.docs serves /docs without a CDN
        redoc_url=None,  # ReDoc would load its script and fonts from a CDN
    )
    app.state.settings = settings
    app.state.db = db
    app.state.checkpoint_stores = stores
    app.state.workspace_stores = workspace_stores
    app.state.claim_waits = ClaimWaits(
        lambda launcher, gpus, limit: count_claimable_jobs(
            db, launcher=launcher, max_gpus_per_node=gpus, limit=limit
        )
    )
    install_error_handlers(app)
    manifest_bytes = settings.max_body_bytes + settings.workspace_max_files * (
        MANIFEST_BODY_BYTES_PER_FILE
    )
    # JSON, HTML, CSV and scripts compress 4-5x (a sweep page's poll, a chart's points):
    # level 1 costs ~0.7 ms per 140 KB of points here and gets most of it. Files (checkpoints,
    # workspace files) go as they are: often incompressible, and sent with byte ranges that
    # a Content-Encoding would shift. Small answers pass as they are.
    app.add_middleware(
        ReadsGZip,
        minimum_size=GZIP_MIN_BYTES,
        compresslevel=1,
        exclude_content_types=(*DEFAULT_EXCLUDED_CONTENT_TYPES, "application/octet-stream"),
    )
    app.add_middleware(
        BodySizeLimit,
        max_bytes=settings.max_body_bytes,
        exempt=CHUNK_UPLOAD_PATH_RE,
        larger=(("POST", WORKSPACE_CREATE_PATH_RE, manifest_bytes),),
    )
    # Added last, so outermost: a plain metric batch skips the layers above and the router.
    app.add_middleware(DirectIngest, max_bytes=settings.max_body_bytes)
    # The metric ingest first: the hottest route, matched before any other router is tried.
    app.include_router(attempts.ingest_router, prefix=API_PREFIX)
    for module in (
        jobs,
        metrics,
        checkpoints,
        logs,
        workers,
        worker_self,
        attempts,
        attempt_checkpoints,
        goodput,
        sweeps,
        sweep_metrics,
        attempt_uploads,
        attempt_downloads,
        attempt_notes,
        attempt_workspace,
        workspaces,
    ):
        app.include_router(module.router, prefix=API_PREFIX)
    app.include_router(health.router)  # /healthz, /readyz where probes expect them
    app.include_router(health.router, prefix=API_PREFIX)
    app.include_router(web_routes.router)
    app.include_router(docs.router)
    if STATIC_DIR.is_dir():
        app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    _install_openapi(app)
    return app
