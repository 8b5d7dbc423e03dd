"""Migrations: upgrade → downgrade → upgrade on a populated database; no autogenerate diff."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from service.core.errors import SchemaOutOfDateError
from service.core.spec.model import JobSpec
from service.store import migrate
from service.store.db import Database
from service.store.jobs import crud as jobs
from service.store.models import Base


def test_up_down_up_on_populated_db(db_url: str) -> None:
    db = Database.from_url(db_url)
    try:
        with pytest.raises(SchemaOutOfDateError, match="ddpq db upgrade"):
            migrate.check_at_head(db.engine)
        migrate.upgrade(db.engine)
        migrate.check_at_head(db.engine)
        with db.session() as s:
            jobs.submit_job(s, JobSpec(name="keep", task="regression"), owner="o")
        migrate.downgrade(db.engine, "base")
        assert migrate.current_revision(db.engine) is None
        assert not {"jobs", "metrics"} & set(inspect(db.engine).get_table_names())
        migrate.upgrade(db.engine)
        assert migrate.current_revision(db.engine) == migrate.head_revision()
        with db.engine.connect() as conn:
            diff = compare_metadata(
                MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata
            )
        assert diff == [], f"models and migrations differ; add a migration: {diff}"
    finally:
        db.dispose()
