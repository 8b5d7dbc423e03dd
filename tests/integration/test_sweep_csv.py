"""The trials CSV over the real app (SQLite and PostgreSQL): override text that a
spreadsheet would run as a formula is quoted with a leading ``'``; numbers stay numbers."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.core.config import Settings
from service.core.wire import API_PREFIX
from service.store.db import Database

API = API_PREFIX
FORMULAS = ['=HYPERLINK("http://x","y")', "+1+1", "-2+3", "@SUM(A1)", "\tx", "\rx"]


@pytest.fixture
def api(settings: Settings, db: Database) -> Iterator[TestClient]:
    allowed = settings.model_copy(update={"allowed_entrypoints": ["mypkg.*"]})
    with TestClient(create_app(allowed)) as client:
        yield client


def test_formula_text_is_neutralised_and_numbers_are_not(api: TestClient) -> None:
    body = {
        "name": "csv",
        "base": {"name": "b", "task": "mypkg.train:main", "training": {"max_steps": 5}},
        "axes": {"config.note": {"grid": [*FORMULAS, "plain"]}, "config.shift": {"grid": [-0.5]}},
    }
    r = api.post(f"{API}/sweeps", json=body)
    assert r.status_code == 201, r.text
    text = api.get(f"{API}/sweeps/{r.json()['id']}/trials", params={"format": "csv"}).text
    rows = list(csv.DictReader(io.StringIO(text, newline="")))
    notes = [row["config.note"] for row in rows]
    assert notes == [f"'{f}" for f in FORMULAS] + ["plain"]
    assert {row["config.shift"] for row in rows} == {"-0.5"}, "a negative number stays a number"
