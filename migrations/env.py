"""Alembic environment: the URL comes from the caller (service.store.migrate) or DDPQ settings."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from service.core.config import get_settings
from service.store.db import make_engine
from service.store.models import Base

config = context.config
target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run against a live connection: one handed in by the caller, else a new engine."""
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = config.get_main_option("sqlalchemy.url") or get_settings().resolved_database_url
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("ddpq migrations run online only: use `ddpq db upgrade`")
run_migrations_online()
