"""Engine construction and the one session scope; driver errors are translated here only."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from service.errors import ConflictError, DatabaseUnavailableError, DdpqError

log = logging.getLogger(__name__)

# Seconds a SQLite writer waits for the write lock before giving up.
SQLITE_BUSY_TIMEOUT_S = 30.0
# Connections a PostgreSQL engine keeps open (and may open again beyond that, briefly).
PG_POOL_SIZE = 16
# Seconds a PostgreSQL connection attempt may take (libpq connect_timeout) unless the URL says
# otherwise: a server that accepts TCP but never answers must not hang a worker or a request.
PG_CONNECT_TIMEOUT_S = 10


def _install_sqlite_hooks(engine: Engine) -> None:
    """WAL, foreign keys, and explicit BEGIN (IMMEDIATE for write scopes) on SQLite.

    pysqlite's own transaction handling defers BEGIN until the first write, which makes a
    read-then-write transaction fail with SQLITE_BUSY instead of waiting; we take the lock
    up front instead (recipe: SQLAlchemy docs, "Serializable isolation / Savepoints /
    Transactional DDL" for pysqlite).
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA synchronous = NORMAL")
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        immediate = conn.get_execution_options().get("ddpq_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def make_engine(url: str, **kwargs: Any) -> Engine:
    """Create an engine for ``url`` (SQLite files get their directory created and WAL mode).

    Raises:
        DatabaseUnavailableError: the URL cannot be parsed.
    """
    try:
        parsed = make_url(url)
    except sa_exc.ArgumentError as exc:
        raise DatabaseUnavailableError(f"invalid database URL: {exc}") from None
    if parsed.get_backend_name() == "sqlite":
        db_path = parsed.database
        if db_path and db_path != ":memory:":
            Path(db_path).parent.mkdir(parents=True, exist_ok=True)
        kwargs.setdefault("connect_args", {"check_same_thread": False, "timeout": 30})
        engine = create_engine(url, **kwargs)
        _install_sqlite_hooks(engine)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    if "connect_timeout" not in parsed.query:
        kwargs["connect_args"] = {"connect_timeout": PG_CONNECT_TIMEOUT_S} | dict(
            kwargs.get("connect_args") or {}
        )
    # Enough pooled connections for the API's threadpool under load: with the default 5 (+10
    # overflow, closed on return) a burst of concurrent requests opened and closed a server
    # backend per request. Connections are opened only when needed.
    kwargs.setdefault("pool_size", PG_POOL_SIZE)
    kwargs.setdefault("max_overflow", PG_POOL_SIZE)
    engine = create_engine(url, **kwargs)
    _install_postgresql_hooks(engine)
    return engine


def _install_postgresql_hooks(engine: Engine) -> None:
    """Each new connection's session runs in UTC: psycopg then hands back timestamps with
    ``datetime.UTC`` itself, which ``models.UTCDateTime`` passes through as they are, instead
    of a server zone such as ``Etc/UTC`` converted row by row (~1 ms per 1,000-point poll).
    Timestamps are stored as ``timestamptz`` either way, so stored values do not change.
    Recipe: SQLAlchemy docs, "Setting a Default Schema for New Connections" (connect event,
    autocommit around the SET so it is not rolled back with the first transaction)."""

    @event.listens_for(engine, "connect", insert=True)
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        autocommit = dbapi_conn.autocommit
        dbapi_conn.autocommit = True
        with dbapi_conn.cursor() as cur:
            cur.execute("SET TIME ZONE 'UTC'")
        dbapi_conn.autocommit = autocommit


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***`` (for logs and errors)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except sa_exc.ArgumentError:
        return "<unparseable database URL>"


@dataclass
class Database:
    """An engine plus its session factories; build one per process with ``Database.from_url``."""

    engine: Engine
    _read: sessionmaker[Session]
    _write: sessionmaker[Session]
    _one_statement: sessionmaker[Session]

    @classmethod
    def from_url(cls, url: str, **engine_kwargs: Any) -> Database:
        """Create the engine for ``url`` and the session factories bound to it."""
        engine = make_engine(url, **engine_kwargs)
        write_engine = engine.execution_options(ddpq_write=True)
        read_engine, one_statement_engine = engine, write_engine
        if engine.dialect.name == "postgresql":
            # Reads run in autocommit: no BEGIN/COMMIT round trips. Under READ COMMITTED each
            # statement had its own snapshot anyway, so a read scope sees the same data. A
            # write that is one statement is atomic by itself: autocommit too.
            read_engine = engine.execution_options(isolation_level="AUTOCOMMIT")
            one_statement_engine = write_engine.execution_options(isolation_level="AUTOCOMMIT")
        return cls(
            engine=engine,
            _read=sessionmaker(bind=read_engine, expire_on_commit=False),
            _write=sessionmaker(bind=write_engine, expire_on_commit=False),
            _one_statement=sessionmaker(bind=one_statement_engine, expire_on_commit=False),
        )

    @property
    def dialect(self) -> str:
        """``"sqlite"`` or ``"postgresql"``."""
        return self.engine.dialect.name

    @contextmanager
    def session(self, *, write: bool = True, one_statement: bool = False) -> Iterator[Session]:
        """A session in one transaction: commit on success, roll back on error.

        ``write=True`` takes SQLite's write lock at BEGIN so read-then-write transactions
        (claims, transitions) wait for the lock instead of failing. ``write=False`` is for
        reads only: on PostgreSQL it runs in autocommit (each statement its own snapshot, as
        under READ COMMITTED), so a write there would not be rolled back on error.
        ``one_statement=True`` is a write scope for work that is a single self-contained
        statement on PostgreSQL (``service.metrics.record_metrics``): it runs in autocommit
        there, saving the BEGIN and COMMIT round trips (bench #6); on SQLite it is the plain
        write scope. Driver errors are turned into ddpq errors here and nowhere else.

        Raises:
            DatabaseUnavailableError: connection or operational failure (HTTP 503).
            ConflictError: an integrity constraint was violated (HTTP 409).
        """
        factory = self._read
        if write:
            factory = self._one_statement if one_statement else self._write
        session = factory()
        try:
            yield session
            session.commit()
        except DdpqError:
            session.rollback()
            raise
        except sa_exc.IntegrityError as exc:
            session.rollback()
            raise ConflictError(f"conflicts with stored data: {exc.orig}") from exc
        except (sa_exc.OperationalError, sa_exc.InterfaceError) as exc:
            _safe_rollback(session)
            log.warning("database error: %s", exc.orig)
            raise DatabaseUnavailableError(
                f"database unavailable: {type(exc.orig).__name__}: {exc.orig}"
            ) from exc
        except sa_exc.DBAPIError as exc:
            _safe_rollback(session)
            raise DatabaseUnavailableError(f"database error: {exc.orig}") from exc
        except BaseException:
            _safe_rollback(session)
            raise
        finally:
            session.close()

    def dispose(self) -> None:
        """Close every pooled connection (call before fork and at shutdown)."""
        self.engine.dispose()


def _safe_rollback(session: Session) -> None:
    # The connection may be gone; then there is nothing to undo.
    with contextlib.suppress(sa_exc.SQLAlchemyError):
        session.rollback()
