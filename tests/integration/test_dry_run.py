"""``POST /jobs?dry_run=true`` over the real app on SQLite and PostgreSQL: the normalised spec,
the launch plan rendered by the launcher's own ``plan`` (golden files, volatile paths
normalised), an existing job's resume point, the queue explanation — and nothing stored.

Regenerate the golden files after an intended change:
``DDPQ_UPDATE_GOLDEN=1 pytest tests/integration/test_dry_run.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from service.app import create_app
from service.core.config import Settings
from service.core.wire import API_PREFIX
from service.store.auth.tokens import create_token
from service.store.db import Database
from service.store.models import Checkpoint, Job, JobEvent
from worker.launchers.preview import PLACEHOLDER_TOKEN

API = API_PREFIX
GOLDEN = Path(__file__).parents[1] / "golden"
SPEC: dict[str, Any] = {
    "name": "reg",
    "task": "regression",
    "resources": {"nproc_per_node": 2},
    "training": {"max_steps": 10},
}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def auth_settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={"auth": "on", "slurm_enabled": True, "api_url": "http://api.example:8000"}
    )


@pytest.fixture
def app_settings(auth_settings: Settings) -> Settings:
    """What this module's ``api`` serves (tests/conftest.py)."""
    return auth_settings


@pytest.fixture
def tokens(db: Database) -> dict[str, str]:
    with db.session() as s:
        return {"alice": create_token(s, owner="alice")[1], "bob": create_token(s, owner="bob")[1]}


def rows(db: Database) -> tuple[int, int, int]:
    """How many jobs, job events and checkpoints are stored."""
    with db.session(write=False) as s:
        return tuple(  # type: ignore[return-value]
            int(s.scalar(select(func.count()).select_from(t)) or 0)
            for t in (Job, JobEvent, Checkpoint)
        )


def normalise(text: str, tmp_path: Path) -> str:
    """Volatile parts of a plan (the test's directories, interpreter, working directory)."""
    return (
        text.replace(str(tmp_path.resolve()), "<tmp>")
        .replace(sys.executable, "<python>")
        .replace(os.getcwd(), "<cwd>")
    )


def check_golden(name: str, text: str) -> None:
    text = text.rstrip("\n")
    path = GOLDEN / name
    if os.environ.get("DDPQ_UPDATE_GOLDEN") == "1":
        path.write_text(text + "\n")
    assert path.exists(), f"missing golden file {path}; create it with DDPQ_UPDATE_GOLDEN=1"
    expected = path.read_text().rstrip("\n")
    assert text == expected, (
        f"plan differs from {path}; if the change is intended, rerun with DDPQ_UPDATE_GOLDEN=1"
        f"\n--- expected\n{expected}\n--- got\n{text}"
    )


def dry_run(api: TestClient, token: str, spec: dict[str, Any], **params: Any) -> Any:
    return api.post(
        f"{API}/jobs", params={"dry_run": "true", **params}, json=spec, headers=bearer(token)
    )


def test_local_dry_run_answers_the_plan_and_stores_nothing(
    api: TestClient, db: Database, tokens: dict[str, str], tmp_path: Path
) -> None:
    before = rows(db)
    r = dry_run(api, tokens["alice"], SPEC)
    assert r.status_code == 200, r.text
    body = r.json()
    assert rows(db) == before, "a dry run stores no job, event or checkpoint"
    assert body["dry_run"] is True and body["job_id"] is None and body["attempt"] == 1
    assert body["spec"]["config"]["hidden"] == 32, "the normalised spec, defaults filled in"
    (plan,) = body["plans"]
    assert plan["launcher"] == "local" and plan["error"] is None
    assert "--nproc_per_node" in plan["argv"] and plan["script"] is None
    assert {"DDPQ_API_URL", "DDPQ_ATTEMPT_TOKEN", "DDPQ_JOB_ID"} <= set(plan["env_names"])
    assert PLACEHOLDER_TOKEN not in r.text, "the attempt token is masked"
    check_golden("dry_run_local.txt", normalise(plan["text"], tmp_path))
    assert body["queue"]["summary"].startswith("no live worker for launcher local")
    assert body["warnings"] == [
        "no worker of launcher local is registered: the job waits until one starts "
        "(`ddpq worker --launcher local`)"
    ]


def test_slurm_dry_run_renders_the_sbatch_script(
    api: TestClient, db: Database, tokens: dict[str, str], tmp_path: Path
) -> None:
    spec = {
        **SPEC,
        "launcher": "slurm",
        "resources": {"nnodes": 2, "nproc_per_node": 2, "timeout_min": 5},
        "slurm": {"partition": "debug"},
    }
    before = rows(db)
    r = dry_run(api, tokens["alice"], spec)
    assert r.status_code == 200, r.text
    assert rows(db) == before
    (plan,) = r.json()["plans"]
    assert plan["argv"] == ["sbatch"] and "#SBATCH --nodes=2" in plan["script"]
    check_golden("dry_run_slurm.txt", normalise(plan["text"], tmp_path))
    bad = {**spec, "slurm": {"extra": {"nodes": "9"}}}
    (refused,) = dry_run(api, tokens["alice"], bad).json()["plans"]
    assert "slurm.extra may not set --nodes" in refused["error"], "explained, not a 500"


def test_resume_point_of_an_existing_job_and_only_ones_own(
    api: TestClient, db: Database, tokens: dict[str, str]
) -> None:
    r = api.post(f"{API}/jobs", json=SPEC, headers=bearer(tokens["alice"]))
    job_id = r.json()["id"]
    fresh = dry_run(api, tokens["alice"], SPEC, job_id=job_id).json()
    assert fresh["resume"]["step"] is None and fresh["attempt"] == 1
    assert fresh["queue"]["position"] == 1, "placed as the job itself"
    with db.session() as s:
        for step in (4, 8):
            s.add(Checkpoint(job_id=job_id, attempt=1, step=step, epoch=step // 4 - 1,
                             path=f"jobs/{job_id}/checkpoints/step-{step}.pt", size_bytes=1,
                             sha256="0" * 64))  # fmt: skip
    before = rows(db)
    body = dry_run(api, tokens["alice"], SPEC, job_id=job_id).json()
    assert rows(db) == before
    assert body["resume"]["step"] == 8 and body["resume"]["epoch"] == 1
    assert body["resume"]["checkpoint_attempt"] == 1
    assert f"# ddpq job {job_id} attempt 1 via local" in body["plans"][0]["text"]
    other = dry_run(api, tokens["bob"], SPEC, job_id=job_id)
    assert other.status_code == 404, "another owner's job can't be used for the resume point"
    assert "step" not in other.text
    plain = api.post(f"{API}/jobs", params={"job_id": job_id}, json=SPEC,
                     headers=bearer(tokens["alice"]))  # fmt: skip
    assert plain.status_code == 422 and "dry_run" in plain.text
    assert rows(db) == before


def test_a_bad_spec_is_refused_as_at_submit(api: TestClient, tokens: dict[str, str]) -> None:
    r = dry_run(api, tokens["alice"], {**SPEC, "resources": {"nproc_per_node": 0}})
    assert r.status_code == 422 and "nproc_per_node" in r.text
    assert dry_run(api, "ddpq_not-a-token", SPEC).status_code == 401


@pytest.mark.parametrize("launcher", ["slurm", "local"])
def test_a_password_in_the_api_url_never_shows_in_a_plan(
    settings: Settings, db: Database, tokens: dict[str, str], launcher: str
) -> None:
    # A password holding "@" and ":" is masked up to the last "@" before the host.
    url = "http://apiuser:Pl@inPw:123@10.0.0.5:8765"
    configured = settings.model_copy(update={"auth": "on", "slurm_enabled": True, "api_url": url})
    spec = {**SPEC, "launcher": launcher, "resources": {"nproc_per_node": 2, "timeout_min": 5}}
    with TestClient(create_app(configured)) as client:
        r = dry_run(client, tokens["alice"], spec)
    assert r.status_code == 200, r.text
    (plan,) = r.json()["plans"]
    assert plan["error"] is None
    for secret in ("Pl@inPw", "inPw:123", "Pw:123", PLACEHOLDER_TOKEN):
        assert secret not in r.text, f"{secret!r} leaked into the dry run's answer"
    assert "http://apiuser:***@10.0.0.5:8765" in plan["text"], "the host is still shown"
    if launcher == "slurm":
        assert "export DDPQ_API_URL=http://apiuser:***@10.0.0.5:8765" in plan["script"]


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("dry_run=true&dry_run=false", "dry_run"),
        ("dry_run=false&dry_run=true", "dry_run"),
        ("dry_run=true&job_id=1&job_id=2", "job_id"),
    ],
)
def test_a_repeated_dry_run_or_job_id_is_refused_and_stores_nothing(
    api: TestClient, db: Database, tokens: dict[str, str], query: str, field: str
) -> None:
    before = rows(db)
    r = api.post(f"{API}/jobs?{query}", json=SPEC, headers=bearer(tokens["alice"]))
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["query", field]
    assert rows(db) == before, "neither planned nor stored"
