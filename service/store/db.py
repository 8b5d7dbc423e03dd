"""Engine construction and the one session scope; driver errors are translated here only."""

from __future__ import annotations

import contextlib
import logging
import os
import select
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from service.core.errors import ConflictError, DatabaseUnavailableError, DdpqError

if TYPE_CHECKING:
    from service.store.loop_pool import LoopPool

log = logging.getLogger(__name__)

T = TypeVar("T")

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


def make_sqlite_files_private(db_path: Path) -> None:
    """Make the SQLite file and its ``-wal``/``-shm``/``-journal`` owner-only (0600): the
    database holds every owner's jobs and the token hashes, and rank processes (another
    Unix user with ``DDPQ_RANK_USER``) must not read it. A missing file is created 0600, so
    SQLite, which gives its side files the main file's mode, creates those private too.
    Files of another owner are left as they are (chmod is the owner's)."""
    with contextlib.suppress(OSError):  # exists already, or SQLite will report why not
        os.close(os.open(db_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    for suffix in ("", "-wal", "-shm", "-journal"):
        with contextlib.suppress(OSError):
            os.chmod(f"{db_path}{suffix}", 0o600)


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
            make_sqlite_files_private(Path(db_path))
        kwargs.setdefault("connect_args", {"check_same_thread": False, "timeout": 30})
        engine = create_engine(url, **kwargs)
        _install_sqlite_hooks(engine)
        return engine
    # A pooled connection the server has closed (restart, pg_terminate_backend, idle timeout)
    # is dropped at checkout by `_drop_if_closed_by_server`, a local poll of its socket
    # (~1 µs); pool_pre_ping's SELECT round trip cost ~100 µs of client CPU per scope, a
    # quarter of a GET /jobs/{id}. Without poll() (Windows), pre-ping as before.
    kwargs.setdefault("pool_pre_ping", not hasattr(select, "poll"))
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
    def _on_connect(dbapi_conn: Any, record: Any) -> None:
        autocommit = dbapi_conn.autocommit
        dbapi_conn.autocommit = True
        with dbapi_conn.cursor() as cur:
            cur.execute("SET TIME ZONE 'UTC'")
        dbapi_conn.autocommit = autocommit
        record.info[_FRESH] = True

    if hasattr(select, "poll"):
        event.listen(engine, "checkout", _drop_if_closed_by_server)


_FRESH = "ddpq_fresh"  # connection record info key: connected, not yet checked out


def _drop_if_closed_by_server(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
    """Pool ``checkout`` hook: refuse a pooled connection the server has closed, so the pool
    opens a new one (SQLAlchemy's documented pessimistic handling via ``DisconnectionError``).

    An idle pooled connection has nothing to read; a readable socket means the server sent
    its "terminating connection" notice and closed it (a restart, pg_terminate_backend).
    Unlike pre-ping this cannot see a connection killed a moment ago whose notice is still
    in flight: ``Database.read`` retries once for that race. A connection just made is
    passed as pre-ping passes it (the pool gives up with a non-driver error after two
    refusals in one checkout; a failing statement gives the usual 503 instead).

    Raises:
        sqlalchemy.exc.DisconnectionError: the connection is closed or closing.
    """
    if record.info.pop(_FRESH, False):
        return
    if dbapi_conn.closed:
        raise sa_exc.DisconnectionError("pooled connection already closed")
    if idle_socket_readable(dbapi_conn.fileno()):
        raise sa_exc.DisconnectionError("the server closed this pooled connection")


def idle_socket_readable(fileno: int) -> bool:
    """Whether an idle database connection's socket ``fileno`` has something to read: the
    server's "terminating connection" notice or its close (an idle connection is sent
    nothing else). A local ``poll``, no round trip; False where ``poll`` is missing."""
    if not hasattr(select, "poll"):
        return False
    poller = select.poll()
    poller.register(fileno, select.POLLIN)
    return bool(poller.poll(0))


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***`` (for logs and errors)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except sa_exc.ArgumentError:
        return "<unparseable database URL>"


def scrub_password(message: str, url: str) -> str:
    """``message`` with the password of database ``url`` (if any) replaced by ``***``."""
    try:
        password = make_url(url).password
    except sa_exc.ArgumentError:
        return message
    return message.replace(str(password), "***") if password else message


@dataclass
class Database:
    """An engine plus its session factories; build one per process with ``Database.from_url``."""

    engine: Engine
    _read_engine: Engine
    _read: sessionmaker[Session]
    _write: sessionmaker[Session]
    _one_statement: sessionmaker[Session]
    # Connections the API's event loop awaits itself (``open_loop_pool``); None elsewhere.
    loop_pool: LoopPool | None = None

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
            _read_engine=read_engine,
            _read=sessionmaker(bind=read_engine, expire_on_commit=False),
            _write=sessionmaker(bind=write_engine, expire_on_commit=False),
            _one_statement=sessionmaker(bind=one_statement_engine, expire_on_commit=False),
        )

    @property
    def dialect(self) -> str:
        """``"sqlite"`` or ``"postgresql"``."""
        return self.engine.dialect.name

    @property
    def on_psycopg(self) -> bool:
        """PostgreSQL through psycopg 3 (the driver ddpq ships), where ``one_row`` runs."""
        return self.dialect == "postgresql" and self.engine.dialect.driver == "psycopg"

    @contextmanager
    def session(self, *, write: bool = True, one_statement: bool = False) -> Iterator[Session]:
        """A session in one transaction: commit on success, roll back on error.

        ``write=True`` takes SQLite's write lock at BEGIN so read-then-write transactions
        (claims, transitions) wait for the lock instead of failing. ``write=False`` is for
        reads only: on PostgreSQL it runs in autocommit (each statement its own snapshot, as
        under READ COMMITTED), so a write there would not be rolled back on error.
        ``one_statement=True`` is a write scope for work that is a single self-contained
        statement on PostgreSQL (``service.store.metrics.pg_ingest.PG_RECORD``): it runs in
        autocommit there, saving the BEGIN and COMMIT round trips; on SQLite it is the plain
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
            raise _translated(exc) from exc
        except sa_exc.DBAPIError as exc:
            _safe_rollback(session)
            raise _translated(exc) from exc
        except BaseException:
            _safe_rollback(session)
            raise
        finally:
            session.close()

    def read(self, fn: Callable[[Connection], T]) -> T:
        """``fn(connection)`` in a read scope on a Core connection, once more on a fresh
        connection if the first turned out dead (a database restart or a killed backend
        since it was pooled): SQLAlchemy's "optimistic" disconnect handling, so the reader
        sees no error when the database is back. ``fn`` must only read: it may run twice.

        Cheaper than ``session(write=False)`` for a hot path (no ORM session, identity map
        or unit of work). On PostgreSQL the connection is in autocommit (no BEGIN/ROLLBACK);
        on SQLite it reads in a deferred transaction, rolled back at the end.

        Raises:
            DatabaseUnavailableError: connection or operational failure (HTTP 503), also
                when the retry fails.
            DdpqError: whatever ``fn`` raises (e.g. NotFoundError), unchanged.
        """
        for attempt in (1, 2):
            try:
                with self._read_engine.connect() as conn:
                    return fn(conn)
            except sa_exc.DBAPIError as exc:
                if attempt == 1 and exc.connection_invalidated:
                    # SQLAlchemy has dropped the dead connection and marked the pool's older
                    # ones stale, so the retry connects afresh.
                    log.info("database connection was closed (%s); retrying once", exc.orig)
                    continue
                raise _translated(exc) from exc
        raise AssertionError("unreachable")  # the loop returns or raises

    def one_row(self, sql: str, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        """The first row of one self-contained statement (None if it returns no row), run
        in autocommit on a pooled PostgreSQL connection through the driver itself: no
        Session, no Core ``Connection``. ``sql`` has the driver's ``%(name)s`` placeholders
        (a ``text()`` compiled for psycopg). The row is a plain tuple in the statement's
        column order: a caller names it with a named tuple class made once (psycopg's
        ``namedtuple_row`` reads the cursor's description on every call). For a hot write
        that is one statement (the metric ingest): on a batch of ~20 points the layers
        skipped cost about as much CPU as the driver's work.
        Pool checkout hooks (a connection the server closed is replaced) apply as for any
        scope; a connection that failed is dropped from the pool.

        Raises:
            ValueError: the database is not PostgreSQL through psycopg (``on_psycopg``).
            DatabaseUnavailableError: connection or operational failure (HTTP 503).
            ConflictError: an integrity constraint was violated (HTTP 409).
        """
        if not self.on_psycopg:
            raise ValueError(
                f"one_row runs on PostgreSQL through psycopg only, not {self.engine.url.drivername}"
            )
        dbapi = self.engine.dialect.loaded_dbapi
        try:
            # The pool hands out the driver's own error for a connection it cannot open.
            pooled = self.engine.raw_connection()
        except sa_exc.DBAPIError as exc:
            raise _translated(exc) from exc
        except dbapi.Error as exc:
            raise _translated_driver_error(sql, exc, dbapi.Error, invalidated=False) from exc
        driver: Any = pooled.driver_connection
        try:
            driver.autocommit = True
            try:
                with driver.cursor() as cursor:
                    cursor.execute(sql, params)
                    return cursor.fetchone()
            finally:
                if not driver.closed:
                    driver.autocommit = False  # as the pool hands it to the next scope
        except dbapi.Error as exc:
            disconnect = self.engine.dialect.is_disconnect(exc, driver, None)
            if disconnect:
                pooled.invalidate(exc)
            raise _translated_driver_error(sql, exc, dbapi.Error, invalidated=disconnect) from exc
        finally:
            pooled.close()

    async def open_loop_pool(self, max_size: int) -> LoopPool | None:
        """On PostgreSQL through psycopg, open ``loop_pool``: at most ``max_size``
        connections, opened as needed, for statements awaited on the running event loop
        (``loop_pool.LoopPool``). Elsewhere, or when one is open already, nothing. Returns
        the pool it opened (None otherwise): close that with ``close_loop_pool``."""
        if not self.on_psycopg or self.loop_pool is not None:
            return None
        from service.store.loop_pool import LoopPool  # PostgreSQL deployments only

        pool = LoopPool(self.engine, max_size, PG_CONNECT_TIMEOUT_S)
        await pool.open()
        self.loop_pool = pool
        return pool

    async def close_loop_pool(self, pool: LoopPool | None) -> None:
        """Close ``pool`` (what ``open_loop_pool`` returned; None: nothing) on the loop that
        opened it, and forget it if it is ``loop_pool``."""
        if pool is None:
            return
        if self.loop_pool is pool:
            self.loop_pool = None
        await pool.close()

    def scrubbed(self, message: str) -> str:
        """``message`` with this database's password (if any) replaced by ``***``."""
        return scrub_password(message, self.engine.url.render_as_string(hide_password=False))

    def dispose(self) -> None:
        """Close every pooled connection (call before fork and at shutdown)."""
        self.engine.dispose()


# What an API client is told when the database cannot be reached (the driver's text is logged).
UNAVAILABLE_PUBLIC = "database unavailable: try again later"


def _translated(exc: sa_exc.DBAPIError) -> DdpqError:
    """The ddpq error a driver error stands for (the one place they are translated)."""
    if isinstance(exc, sa_exc.IntegrityError):
        return ConflictError(
            f"conflicts with stored data: {exc.orig}", public="conflicts with stored data"
        )
    if isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError):
        log.warning("database error: %s", exc.orig)
        return DatabaseUnavailableError(
            f"database unavailable: {type(exc.orig).__name__}: {exc.orig}",
            public=UNAVAILABLE_PUBLIC,
        )
    return DatabaseUnavailableError(f"database error: {exc.orig}", public="database error")


def _translated_driver_error(
    sql: str, exc: Exception, dbapi_error: type[Exception], *, invalidated: bool
) -> DdpqError:
    """``_translated`` for an error the driver raised outside SQLAlchemy's execution layer
    (``Database.one_row``): wrapped as SQLAlchemy wraps it, then translated alike."""
    wrapped = sa_exc.DBAPIError.instance(
        sql, None, exc, dbapi_error, connection_invalidated=invalidated
    )
    assert isinstance(wrapped, sa_exc.DBAPIError)  # a driver error is wrapped as one
    return _translated(wrapped)


def _safe_rollback(session: Session) -> None:
    # The connection may be gone; then there is nothing to undo.
    with contextlib.suppress(sa_exc.SQLAlchemyError):
        session.rollback()
