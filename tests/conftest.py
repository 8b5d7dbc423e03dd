"""Shared fixtures: settings in a temp dir, and a migrated database on SQLite and PostgreSQL.

PostgreSQL comes from ``DDPQ_TEST_PG_URL`` (default: the local server's ``test`` database);
each test gets its own schema, dropped afterwards. Set ``DDPQ_TEST_SKIP_PG=1`` to run the
SQLite half alone on a machine without PostgreSQL (CI never sets it).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from sqlalchemy import create_engine, text

from service.core.config import Settings
from service.store import migrate
from service.store.db import Database

PG_URL = os.environ.get("DDPQ_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
SKIP_PG = os.environ.get("DDPQ_TEST_SKIP_PG") == "1"


def _pg_schema_url(schema: str) -> str:
    sep = "&" if "?" in PG_URL else "?"
    return f"{PG_URL}{sep}options={quote(f'-csearch_path={schema}')}"


@pytest.fixture
def pg_schema_url() -> Iterator[str]:
    """A database URL whose search_path is a fresh, empty PostgreSQL schema."""
    if SKIP_PG:
        pytest.skip("DDPQ_TEST_SKIP_PG=1")
    schema = f"t_{uuid.uuid4().hex[:12]}"
    # pre-ping: a test may restart the server meanwhile (tests/e2e/test_db_outage.py)
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        yield _pg_schema_url(schema)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database's URL, once for SQLite and once for PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ddpq.db'}"
    return str(request.getfixturevalue("pg_schema_url"))


@pytest.fixture
def settings(tmp_path: Path, db_url: str) -> Settings:
    """Settings for one test: its own database and artifact dir under ``tmp_path``."""
    return Settings(
        home=tmp_path / ".ddpq",
        database_url=db_url,
        artifact_dir=tmp_path / "artifacts",
        allowed_entrypoints=["examples.*:*"],
    )


@pytest.fixture
def db(settings: Settings) -> Iterator[Database]:
    """A migrated database (at head) for ``settings``."""
    database = Database.from_url(settings.resolved_database_url)
    migrate.upgrade(database.engine)
    yield database
    database.dispose()
