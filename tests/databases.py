"""Migrated databases made once per test session and cloned per test (as procrastinate's
fixtures do): Alembic runs from zero once per dialect and xdist worker, not once per test.

- SQLite: a migrated file, copied to each test's path (a file copy: milliseconds).
- PostgreSQL: a migrated schema, dumped once with ``pg_dump`` (schema and rows: the Alembic
  version, whatever the migrations seed) and replayed into each test's fresh schema in one
  round trip. Without ``pg_dump`` on the PATH each test migrates as before.

A test that needs an empty database (the migration tests, ``ddpq db upgrade``) takes
``db_url`` or ``settings`` without ``db`` and gets one.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

from sqlalchemy import create_engine, make_url, text

from service.store import migrate
from service.store.db import Database


def migrated_sqlite_file(directory: Path) -> Path:
    """A SQLite file at Alembic head, made in ``directory``."""
    path = directory / "template.db"
    database = Database.from_url(f"sqlite:///{path}")
    try:
        migrate.upgrade(database.engine)
    finally:
        database.dispose()
    return path


def clone_sqlite(template: Path, url: str) -> None:
    """Copy ``template`` to the file of the SQLite ``url`` (which must not exist yet)."""
    target = Path(str(make_url(url).database))
    if target.exists():
        raise FileExistsError(f"{target} exists: a test's database is cloned once")
    shutil.copyfile(template, target)


def pg_schema_dump(pg_url: str, schema_url: str, schema: str) -> str | None:
    """The SQL that rebuilds ``schema`` (migrated to head through ``schema_url``) in another
    schema: its DDL and rows with ``schema`` as the placeholder ``schema`` itself; None when
    ``pg_dump`` is not on the PATH (callers migrate instead)."""
    if shutil.which("pg_dump") is None:
        return None
    database = Database.from_url(schema_url)
    try:
        migrate.upgrade(database.engine)
    finally:
        database.dispose()
    libpq_url = make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)
    dump = subprocess.run(
        ["pg_dump", "--dbname", libpq_url, "--schema", schema, "--inserts", "--no-owner",
         "--no-privileges", "--no-comments"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    # The test's schema exists already (its fixture made it); psql's meta-commands (newer
    # pg_dumps wrap the dump in \restrict … \unrestrict) are not SQL; the rest is replayed.
    lines = [ln for ln in dump.stdout.splitlines() if not ln.startswith(("CREATE SCHEMA", "\\"))]
    return "\n".join(lines)


def replay_pg_dump(schema_url: str, dump: str, template_schema: str, schema: str) -> None:
    """Rebuild the template's tables, indexes and rows in the empty ``schema``."""
    engine = create_engine(schema_url)
    try:
        raw = engine.raw_connection()
        try:
            with raw.cursor() as cursor:
                cursor.execute(dump.replace(template_schema, schema))
            raw.commit()
        finally:
            raw.close()
    finally:
        engine.dispose()


def unique_schema_name(prefix: str = "t") -> str:
    """A fresh schema name (lowercase, unquoted-safe)."""
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


def drop_schema(pg_url: str, schema: str) -> None:
    """Drop ``schema`` and everything in it, if it exists."""
    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    try:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    finally:
        admin.dispose()
