"""Slurm options reach the sbatch script as ``#SBATCH`` lines: over the real app on SQLite and
PostgreSQL, a control character in any ``slurm.*`` string is a 422 naming the field (a job)
or the trial (a sweep), and nothing is stored."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from service.core.config import Settings
from service.core.wire import API_PREFIX
from service.store.db import Database
from service.store.models import Job, Sweep

API = API_PREFIX
BASE: dict[str, Any] = {"name": "s", "task": "regression", "launcher": "slurm"}


@pytest.fixture
def app_settings(settings: Settings) -> Settings:
    """What this module's ``api`` serves (tests/conftest.py)."""
    return settings.model_copy(update={"slurm_enabled": True})


def stored(db: Database) -> tuple[int, int]:
    with db.session(write=False) as s:
        return (
            int(s.scalar(select(func.count()).select_from(Job)) or 0),
            int(s.scalar(select(func.count()).select_from(Sweep)) or 0),
        )


@pytest.mark.parametrize(
    ("slurm", "loc"),
    [
        ({"partition": "debug\n#SBATCH --uid=0"}, ["slurm", "partition"]),
        ({"account": "ml\r"}, ["slurm", "account"]),
        ({"qos": "hi\x00gh"}, ["slurm", "qos"]),
        ({"constraint": "a100\u2028x"}, ["slurm", "constraint"]),
        ({"extra": {"comment": "x\ntouch /tmp/pwned #"}}, ["slurm", "extra", "comment"]),
        ({"extra": {"comment\n#SBATCH --uid": "0"}}, ["slurm", "extra"]),
    ],
)
def test_a_control_character_in_a_slurm_option_is_422_naming_the_field(
    api: TestClient, db: Database, slurm: dict[str, Any], loc: list[str]
) -> None:
    r = api.post(f"{API}/jobs", json={**BASE, "slurm": slurm})
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"][1 : 1 + len(loc)] == loc, error
    assert "control character" in error["msg"]
    assert stored(db) == (0, 0), "nothing stored"
    dry = api.post(f"{API}/jobs", params={"dry_run": "true"}, json={**BASE, "slurm": slurm})
    assert dry.status_code == 422, "a dry run refuses it as a submit does"
    plain = {"partition": "debug", "extra": {"comment": "a b#c"}}
    fine = api.post(f"{API}/jobs", json={**BASE, "slurm": plain})
    assert fine.status_code == 201, fine.text


def test_a_sweep_axis_setting_a_slurm_option_with_a_newline_names_the_trial(
    api: TestClient, db: Database
) -> None:
    body = {
        "name": "inject",
        "base": BASE,
        "axes": {"slurm.partition": {"grid": ["debug", "debug\n#SBATCH --uid=0"]}},
    }
    r = api.post(f"{API}/sweeps", json=body)
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["body", "trials", 1, "slurm.partition"], error
    assert error["msg"].startswith("trial 1 (") and "control character" in error["msg"]
    assert stored(db) == (0, 0), "nothing stored"
