"""PostgreSQL connections the API's event loop uses itself, for a hot write that is one
statement (the metric ingest, ``metrics.service.record_columns_on_loop``).

Every other database call runs in a worker thread on SQLAlchemy's pool (``db.Database``).
For a batch of ~20 points the hop to that thread and back, the pool's checkout and the
GIL handed between the two threads cost about a fifth of the API's CPU per batch
(``bench/ingest_cpu.py``); a statement awaited on the loop costs none of that. The pool is
psycopg's own (``psycopg_pool.AsyncConnectionPool``; recipe: psycopg docs, "Connection
pools"), opened in the app's lifespan, so it lives on the loop that serves the requests.

It is a fast path only: ``one_row`` answers None for anything but a row (no connection
within ``CONNECTION_WAIT_S``, a driver error, a closed pool), and the caller then does the
same work the usual way, whose errors are the ones a client sees.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool
from sqlalchemy import Engine

from service.store.db import idle_socket_readable

log = logging.getLogger(__name__)

# Seconds a statement waits for a pooled connection before its caller goes the usual way. The
# ingest's limiter lets no more batches in than the pool holds, so a healthy pool has one
# ready; this is waited while one is being opened (the first batches, after a restart).
CONNECTION_WAIT_S = 0.25
# Seconds the pool is left alone after it could not give a connection or a statement failed
# for want of one (the database is down or restarting): batches go the usual way meanwhile,
# which answers 503 at once when the database cannot be reached.
RESTING_S = 5.0
# Seconds the pool keeps trying to replace a lost connection before it gives up (and opens
# one again on demand): psycopg_pool's own default, 300 s of growing backoff, held the slot
# and kept the pool from opening a fresh connection long after the database was back.
RECONNECT_TIMEOUT_S = 5.0


class LoopPool:
    """Autocommit psycopg connections (at most ``max_size``; opened on first use, and again
    after one is lost) to ``engine``'s database, with the engine's connection parameters
    (``connect_timeout`` seconds unless its URL gives one), each set to UTC as
    ``db._install_postgresql_hooks`` sets the engine's.

    It serves only the event loop that ran ``open``: called from any other, ``one_row``
    answers None and ``close`` leaves the pool as it is."""

    def __init__(self, engine: Engine, max_size: int, connect_timeout: int) -> None:
        _, params = engine.dialect.create_connect_args(engine.url)
        # SQLAlchemy's adapters map stays out: the statements here take plain values.
        kwargs: dict[str, Any] = {k: v for k, v in params.items() if k != "context"}
        kwargs.setdefault("connect_timeout", connect_timeout)
        # Named after this process, so an operator (or a test) tells its connections apart.
        kwargs.update(autocommit=True, application_name=application_name())
        self._pool: AsyncConnectionPool = AsyncConnectionPool(
            "",
            kwargs=kwargs,
            min_size=0,
            max_size=max_size,
            open=False,
            configure=_in_utc,
            check=_refuse_if_closed_by_server,
            timeout=CONNECTION_WAIT_S,
            reconnect_timeout=RECONNECT_TIMEOUT_S,
            name="ddpq-loop",
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._resting_until = 0.0
        # Statements that ran to their row here (the rest went the usual way).
        self.statements_run = 0

    async def open(self) -> None:
        """Start the pool on the running event loop (no connection opened yet)."""
        self._loop = asyncio.get_running_loop()
        await self._pool.open(wait=False)

    async def close(self) -> None:
        """Close every connection (from the loop that opened it; elsewhere nothing):
        ``one_row`` answers None from then on."""
        if self._on_own_loop():
            await self._pool.close()

    def _on_own_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:  # no running loop
            return False

    async def one_row(self, sql: str, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        """The first row of one self-contained statement, as a plain tuple, run in
        autocommit. None if it returned no row or did not run here: another event loop,
        the pool resting (``RESTING_S`` after it failed for want of a connection), no
        connection within ``CONNECTION_WAIT_S``, a driver error (logged). The caller then
        does it the usual way (``Database.one_row`` in a thread), whose answer is the one a
        client sees. ``sql`` has psycopg's ``%(name)s`` placeholders. A connection that
        failed is dropped by the pool on its return."""
        if not self._on_own_loop() or time.monotonic() < self._resting_until:
            return None
        try:
            async with self._pool.connection() as conn, conn.cursor() as cursor:
                await cursor.execute(sql, params)
                row: tuple[Any, ...] | None = await cursor.fetchone()
                self.statements_run += 1
                return row
        except psycopg.OperationalError as exc:  # PoolTimeout and PoolClosed are ones too
            self._resting_until = time.monotonic() + RESTING_S
            log.info("no database connection on the event loop, resting %.0f s: %s", RESTING_S, exc)
        except psycopg.Error as exc:
            log.info("statement on the event loop failed, done the usual way: %s", exc)
        return None


def application_name() -> str:
    """The ``application_name`` of this process's loop connections (``pg_stat_activity``)."""
    return f"ddpq-api-loop-{os.getpid()}"


async def _in_utc(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute("SET TIME ZONE 'UTC'")


async def _refuse_if_closed_by_server(conn: psycopg.AsyncConnection[Any]) -> None:
    """The pool's checkout check, as ``db._drop_if_closed_by_server`` (a local poll of the
    socket, no round trip): an idle connection has nothing to read, so a readable one was
    closed by the server. It is closed here too, so that the pool (which raising makes take
    another) replaces it instead of keeping it: the pool keeps a connection whose driver
    still reads it as idle."""
    if not conn.closed:
        if not idle_socket_readable(conn.fileno()):
            return
        await conn.close()
    raise psycopg.OperationalError("the server closed this pooled connection")
