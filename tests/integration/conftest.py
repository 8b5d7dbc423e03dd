"""Fixtures shared by the integration tests of the API with auth on."""

from __future__ import annotations

import pytest

from service.store.auth.tokens import create_token
from service.store.db import Database
from tests.resume_api import bearer


@pytest.fixture
def users(db: Database) -> dict[str, dict[str, str]]:
    """Request headers of two owners, alice and bob, each with a user token of their own."""
    with db.session() as s:
        return {o: bearer(create_token(s, owner=o)[1]) for o in ("alice", "bob")}
