"""Worker credentials for tests that start real workers: a worker token minted on the test's
database, and the settings or environment a worker runs with (the API's URL and that token;
never the database URL, which a worker refuses)."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import SecretStr

from service.core.config import Settings
from service.store.auth import service as auth
from service.store.db import Database
from worker.up import worker_env


def mint_worker_token(database: Database | str, name: str = "test-worker") -> str:
    """A new worker token on ``database`` (a Database or its URL)."""
    if isinstance(database, str):
        db = Database.from_url(database)
        try:
            return auth.create_worker_token(db, name=name).token
        finally:
            db.dispose()
    return auth.create_worker_token(database, name=name).token


def worker_settings(settings: Settings, token: str) -> Settings:
    """``settings`` as a worker holds them: no database URL, the worker token."""
    return settings.model_copy(update={"database_url": None, "worker_token": SecretStr(token)})


def worker_environ(settings: Settings, token: str, base: Mapping[str, str]) -> dict[str, str]:
    """A worker process's environment: ``base`` and ``settings`` without the database URL,
    with the worker token and the API URL (``worker.up.worker_env``)."""
    return worker_env(settings, token, dict(base))
