"""What a local attempt's ranks get: the allow-listed environment plus the plan's entries (API
URL, attempt token), never the worker's database URL or user token; and their spec as a
0600 file in the attempt directory. Real torchrun, with the stand-in rank
``tests/e2e/rank_user_probe.py`` (standard library only) as the per-rank program."""

from __future__ import annotations

import json
import stat
import time
from dataclasses import replace
from pathlib import Path

import pytest

from service.core.config import Settings
from service.core.spec.model import JobSpec
from worker.launchers.base import RunPhase, with_attempt_token
from worker.launchers.local.launcher import LocalLauncher

PROBE = Path(__file__).resolve().parents[1] / "e2e" / "rank_user_probe.py"
SLOW_BOX_S = 180.0


def test_ranks_get_the_api_url_and_token_and_none_of_the_workers_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DDPQ_DATABASE_URL", "postgresql://u:secret@db.example/ddpq")
    monkeypatch.setenv("DDPQ_TOKEN", "ddpq_user-token")
    monkeypatch.setenv("DDPQ_AUTH", "on")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    settings = Settings(
        home=tmp_path, artifact_dir=tmp_path / "artifacts", api_url="http://api.example:8000"
    )
    launcher = LocalLauncher(settings, entry=(str(PROBE),))
    spec = JobSpec.model_validate(
        {"name": "env", "task": "regression", "resources": {"nproc_per_node": 2}}
    )
    plan = with_attempt_token(launcher.plan(spec, 3, 1), "ddpqa_the-token")
    plan = replace(plan, env={**plan.env, "PROBE_DB_PATH": str(tmp_path / "no.db")})
    handle = launcher.start(plan)
    deadline = time.monotonic() + SLOW_BOX_S
    while (status := launcher.poll(handle)).phase in (RunPhase.PENDING, RunPhase.RUNNING):
        assert time.monotonic() < deadline, "the attempt did not end in time"
        time.sleep(0.1)
    attempt_dir = Path(plan.log_dir)
    assert status.phase == RunPhase.SUCCEEDED, (attempt_dir / "launcher.log").read_text()
    for rank in (0, 1):
        probe = json.loads((attempt_dir / f"user-probe-rank-{rank}.json").read_text())
        assert probe["ddpq_env"] == [
            "DDPQ_API_URL", "DDPQ_ARTIFACT_DIR", "DDPQ_ATTEMPT", "DDPQ_ATTEMPT_TOKEN",
            "DDPQ_CHECKPOINT_DIR",
            "DDPQ_JOB_ID",
        ], "a rank's DDPQ_* variables are the plan's, none of the worker's"  # fmt: skip
        assert "secret" not in probe["ancestors"].values(), probe["ancestors"]
        assert probe["spec"] == "readable"
    spec_file = attempt_dir / "spec.json"
    assert stat.S_IMODE(spec_file.stat().st_mode) == 0o600
    assert JobSpec.model_validate_json(spec_file.read_text()) == spec
