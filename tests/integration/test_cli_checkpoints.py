"""`ddpq checkpoints N` and `ddpq checkpoints N --download STEP -o FILE` against a live API
(uvicorn, real HTTP) on SQLite and PostgreSQL, for a checkpoint in either store: the table,
a verified download, and a corrupted file refused with nothing left behind."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from service.app import create_app
from service.cli.main import app
from service.core import artifacts
from service.core.config import Settings
from service.store.db import Database
from tests.live import serve_app
from tests.uploads import mint, running_job, sha, upload

runner = CliRunner()
CHUNK = 64 * 1024


@pytest.fixture(params=["filesystem", "database"])
def store_settings(request: pytest.FixtureRequest, settings: Settings) -> Settings:
    return settings.model_copy(
        update={"checkpoint_store": request.param, "checkpoint_chunk_bytes": CHUNK}
    )


@pytest.fixture
def live_url(store_settings: Settings, db: Database) -> Iterator[str]:
    with serve_app(create_app(store_settings)) as url:
        yield url


def ddpq(url: str, *args: str) -> Any:
    return runner.invoke(app, list(args), env={"DDPQ_API_URL": url, "COLUMNS": "200"})


def test_list_and_download_a_checkpoint(
    live_url: str, db: Database, store_settings: Settings, tmp_path: Path
) -> None:
    job_id = running_job(db, "local")
    data = os.urandom(3 * CHUNK + 11)
    with httpx.Client(base_url=live_url, timeout=30) as api:
        assert upload(api, mint(db, job_id), data, 30, CHUNK).status_code == 201

    result = ddpq(live_url, "checkpoints", str(job_id))
    assert result.exit_code == 0, result.output
    assert "30" in result.output and sha(data)[:12] in result.output, result.output
    assert store_settings.checkpoint_store in result.output

    dest = tmp_path / "ckpt.pt"
    result = ddpq(live_url, "checkpoints", str(job_id), "--download", "30", "-o", str(dest))
    assert result.exit_code == 0, result.output
    assert "sha256 verified" in result.output
    assert dest.read_bytes() == data

    result = ddpq(live_url, "checkpoints", str(job_id), "--download", "31", "-o", str(dest))
    assert result.exit_code == 2 and "no checkpoint at step 31" in result.output, result.output
    result = ddpq(live_url, "checkpoints", str(job_id), "--download", "30")
    assert result.exit_code == 2 and "-o FILE" in result.output, result.output


def test_a_download_that_does_not_match_its_sha256_is_refused(
    live_url: str, db: Database, settings: Settings, tmp_path: Path
) -> None:
    job_id = running_job(db, "local")
    data = os.urandom(2 * CHUNK)
    with httpx.Client(base_url=live_url, timeout=30) as api:
        assert upload(api, mint(db, job_id), data, 8, CHUNK).status_code == 201
    # The filesystem store's file of step 8, under its upload's own name.
    found = list(artifacts.checkpoint_dir(settings.resolved_artifact_dir, job_id).glob("step-8.*"))
    if not found:
        pytest.skip("the database store's rows are not tampered with here")
    [stored] = found
    stored.write_bytes(b"\0" + data[1:])  # rotted on the server's disk
    dest = tmp_path / "ckpt.pt"
    result = ddpq(live_url, "checkpoints", str(job_id), "--download", "8", "-o", str(dest))
    assert result.exit_code == 1, result.output
    assert "sha256" in result.output and "download it again" in result.output, result.output
    assert not dest.exists() and not list(tmp_path.glob("*.part")), "nothing left behind"
