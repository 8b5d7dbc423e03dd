"""Fixtures shared by the integration tests of the API with auth on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from service.app import create_app
from service.core.config import Settings
from service.store.auth.tokens import create_token
from service.store.db import Database
from tests.live import serve_app
from tests.resume_api import bearer


@pytest.fixture
def users(db: Database) -> dict[str, dict[str, str]]:
    """Request headers of two owners, alice and bob, each with a user token of their own."""
    with db.session() as s:
        return {o: bearer(create_token(s, owner=o)[1]) for o in ("alice", "bob")}


@pytest.fixture
def live_url(settings: Settings, db: Database) -> Iterator[str]:
    """The API of ``settings`` served by uvicorn in a thread on a free loopback port (a
    module that needs other settings defines its own ``live_url``)."""
    with serve_app(create_app(settings)) as url:
        yield url
