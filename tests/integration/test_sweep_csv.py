"""The trials CSV over the real app (SQLite and PostgreSQL): override text that a
spreadsheet would run as a formula is quoted with a leading ``'``; numbers stay numbers."""

from __future__ import annotations

import csv
import io

import pytest
from fastapi.testclient import TestClient

from service.core.config import Settings
from service.core.wire import API_PREFIX

API = API_PREFIX
FORMULAS = ['=HYPERLINK("http://x","y")', "+1+1", "-2+3", "@SUM(A1)", "\tx", "\rx"]


@pytest.fixture
def app_settings(settings: Settings) -> Settings:
    """What this module's ``api`` serves (tests/conftest.py)."""
    return settings.model_copy(update={"allowed_entrypoints": ["mypkg.*"]})


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
