"""The sweep and compare pages' server side without a browser (the real app, real SQLite and
PostgreSQL, auth off): page shells with the strict policy, root-relative assets, and the 404
page of a sweep that does not exist."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.core.config import Settings
from service.core.wire import API_PREFIX
from service.store.db import Database

SWEEP = {
    "name": "grid",
    "base": {"name": "b", "task": "regression", "training": {"max_steps": 5}},
    "axes": {"training.lr": {"grid": [0.001, 0.01]}},
}


@pytest.fixture
def client(settings: Settings, db: Database) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


def test_pages_are_shells_with_a_strict_policy_and_a_nav_link(client: TestClient) -> None:
    r = client.post(API_PREFIX + "/sweeps", json=SWEEP)
    assert r.status_code == 201, r.text
    sweep_id = r.json()["id"]
    for path in ("/sweeps", f"/sweeps/{sweep_id}", "/compare", "/compare?jobs=1,2"):
        page = client.get(path)
        assert page.status_code == 200, path
        assert "script-src 'self'" in page.headers["content-security-policy"], path
        assert 'href="/sweeps"' in page.text, f"{path}: the nav links the sweep list"
        assert "grid" not in page.text, f"{path}: the shell carries no sweep data"
        for url in re.findall(r'(?:src|href)="([^"]*/static/[^"]*)"', page.text):
            assert url.startswith("/static/"), f"{path}: {url} is not root-relative"
    assert f'data-sweep-id="{sweep_id}"' in client.get(f"/sweeps/{sweep_id}").text


@pytest.mark.parametrize("sweep_id", ["999999", "0", str(2**63)])
def test_a_missing_sweep_is_a_404_page_with_a_way_back(client: TestClient, sweep_id: str) -> None:
    page = client.get(f"/sweeps/{sweep_id}")
    assert page.status_code == 404
    assert f"Sweep {sweep_id} was not found" in page.text
    assert 'href="/"' in page.text
