"""Schema migrations through Alembic: upgrade, downgrade, and the "is it at head?" check."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Engine, text
from sqlalchemy import exc as sa_exc

from service.core.errors import DatabaseUnavailableError, MigrationError, SchemaOutOfDateError
from service.store.db import UNAVAILABLE_PUBLIC, Database, redact_url

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


@contextmanager
def migration_errors(url: str) -> Iterator[None]:
    """Translate what Alembic and the driver raise while migrating ``url`` into
    ``MigrationError`` (its message names the database without its password).

    Raises:
        MigrationError: Alembic refused (unknown revision, …) or the database failed.
    """
    try:
        yield
    except CommandError as exc:
        raise MigrationError(
            f"migration failed: {exc}", hint="list revisions with `ddpq db current`"
        ) from exc
    except sa_exc.SQLAlchemyError as exc:
        reason = getattr(exc, "orig", None) or exc
        raise MigrationError(
            f"database {redact_url(url)}: {type(reason).__name__}: {reason}",
            hint="check that the database runs and DDPQ_DATABASE_URL points at it",
        ) from exc


def alembic_config(url: str) -> Config:
    """An Alembic config for ``url`` pointing at the project's migrations."""
    cfg = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("version_locations", str(MIGRATIONS_DIR / "versions"))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Migrate the database behind ``engine`` up to ``revision``."""
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def downgrade(engine: Engine, revision: str) -> None:
    """Migrate the database behind ``engine`` down to ``revision`` (``"base"`` empties it)."""
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def head_revision() -> str | None:
    """The newest revision in ``migrations/versions``."""
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at (None when never migrated)."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def check_at_head(engine: Engine) -> None:
    """Raise unless the database is at the head revision.

    Raises:
        SchemaOutOfDateError: with the command that fixes it.
    """
    current, head = current_revision(engine), head_revision()
    if current != head:
        raise SchemaOutOfDateError(
            f"database {redact_url(engine.url.render_as_string(hide_password=False))} is at "
            f"revision {current or 'none (empty)'}, code expects {head}: run `ddpq db upgrade`"
        )


def check_database(db: Database) -> None:
    """Raise unless the database answers and its schema is at the head revision (what
    ``/readyz``, ``ddpq serve`` and the token commands check before they go on).

    Raises:
        DatabaseUnavailableError: the database cannot be reached (503).
        SchemaOutOfDateError: not migrated to head; the message says to run `ddpq db upgrade`.
    """
    with db.session(write=False) as session:
        session.execute(text("SELECT 1"))
    try:
        check_at_head(db.engine)
    except sa_exc.SQLAlchemyError as exc:
        # The database went away between the two checks; same answer as the first one.
        raise DatabaseUnavailableError(
            f"database unavailable: {type(exc).__name__}", public=UNAVAILABLE_PUBLIC
        ) from exc
