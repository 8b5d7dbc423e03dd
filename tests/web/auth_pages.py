"""Shared by the compare and sweep page tests: a live server with auth on, owners' tokens,
seeded jobs with curves, and signing a page in through the token form."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from service.core.states import JobState
from service.store.auth.tokens import create_token
from tests.web.conftest import LiveServer, WatchedPage, served

UNAUTHORIZED = r"status of 401"
NOT_FOUND = r"status of 404"


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """Like the shared fixture, but with auth on (a module that imports it gets it)."""
    with served(tmp_path_factory.mktemp("web-auth"), auth="on") as server:
        yield server


@pytest.fixture(scope="module")
def tokens(live_server: LiveServer) -> dict[str, str]:
    """An API token each for alice and bob."""
    found = {}
    for owner in ("alice", "bob"):
        with live_server.db.session() as s:
            found[owner] = create_token(s, owner=owner)[1]
    return found


def bearer(token: str) -> dict[str, str]:
    """The Authorization header for ``token``."""
    return {"Authorization": f"Bearer {token}"}


def run_job(
    srv: LiveServer,
    token: str,
    name: str,
    curves: dict[str, list[float]],
    *,
    state: JobState = JobState.SUCCEEDED,
    **spec: Any,
) -> dict[str, Any]:
    """Submit a regression job as ``token``'s owner, run it through the real domain
    functions, record ``curves`` ({metric: values at steps 1…}) and end it in ``state``
    (``RUNNING`` leaves it running). Returns the job as the API shows it."""
    body: dict[str, Any] = {"name": name, "task": "regression", "training": {"max_steps": 50}}
    body["priority"] = 1000  # the top: start() claims it (every seeded job is started at once)
    body.update(spec)
    res = srv.api.post("/jobs", json=body, headers=bearer(token))
    assert res.status_code == 201, res.text
    job_id = int(res.json()["id"])
    srv.start(job_id)
    for metric, values in curves.items():
        srv.report(job_id, values, name=metric, total_steps=50)
    if state != JobState.RUNNING:
        srv.finish(job_id, state)
    got = srv.api.get(f"/jobs/{job_id}", headers=bearer(token))
    assert got.status_code == 200, got.text
    job: dict[str, Any] = got.json()
    return job


def sign_in(w: WatchedPage, token: str) -> None:
    """Enter ``token`` in the page's token form (the page reloads with it)."""
    w.allow_console(UNAUTHORIZED)  # Chromium logs the first, refused API call
    w.page.locator("#auth-panel").wait_for(state="visible")
    w.page.fill("#auth-token", token)
    w.page.click("#auth-submit")
    w.page.locator("#auth-panel").wait_for(state="hidden")
