"""Golden-file tests of the local launcher's plan (torchrun command line + environment).

Regenerate after an intended change:
``DDPQ_UPDATE_GOLDEN=1 pytest tests/unit/test_local_launcher_plan.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from service.core.config import Settings
from service.core.spec.model import JobSpec
from worker.attempt import API_URL, ATTEMPT_TOKEN, DATABASE_URL
from worker.launchers.base import with_attempt_token
from worker.launchers.local.launcher import LocalLauncher, LocalRequest

GOLDEN = Path(__file__).parents[1] / "golden"


def _settings(tmp_path: Path) -> Settings:
    return Settings(
        home=tmp_path / ".ddpq",
        database_url="postgresql+psycopg://ddpq:s3cret@db.example/ddpq",
        artifact_dir=tmp_path / "artifacts",
        api_url="http://api.example:8000",
    )


def _normalise(text: str, tmp_path: Path) -> str:
    return text.replace(str(tmp_path.resolve()), "<tmp>").replace(sys.executable, "<python>")


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("DDPQ_UPDATE_GOLDEN") == "1":
        path.write_text(text + "\n")
    assert path.exists(), f"missing golden file {path}; create it with DDPQ_UPDATE_GOLDEN=1"
    expected = path.read_text().rstrip("\n")
    assert text == expected, (
        f"plan differs from {path}; if the change is intended, rerun with DDPQ_UPDATE_GOLDEN=1"
        f"\n--- expected\n{expected}\n--- got\n{text}"
    )


@pytest.fixture
def launcher(tmp_path: Path) -> LocalLauncher:
    (tmp_path / "cwd").mkdir()
    return LocalLauncher(_settings(tmp_path), cwd=tmp_path / "cwd")


def test_cpu_plan_matches_golden(launcher: LocalLauncher, tmp_path: Path) -> None:
    spec = JobSpec.model_validate(
        {
            "name": "golden",
            "task": "regression",
            "resources": {"nproc_per_node": 2, "cpus_per_task": 2, "timeout_min": 5},
        }
    )
    plan = with_attempt_token(launcher.plan(spec, 7, 3), "ddpqa_s3cret-token")
    text = plan.render()
    _check_golden("local_plan_cpu.txt", _normalise(text, tmp_path))
    assert plan.request == LocalRequest(timeout_s=300.0)
    assert plan.log_dir == str(tmp_path.resolve() / "artifacts/jobs/7/attempt-3")
    assert "s3cret" not in text, "the rendered plan must mask the token, name no database"


def test_ranks_get_the_api_url_and_token_never_the_database(launcher: LocalLauncher) -> None:
    plan = with_attempt_token(launcher.plan(JobSpec(name="x", task="regression"), 1, 1), "tok")
    assert plan.env[API_URL] == "http://api.example:8000"
    assert plan.env[ATTEMPT_TOKEN] == "tok"
    assert DATABASE_URL not in plan.env
    assert not any("s3cret" in value for value in plan.env.values())


def test_the_spec_travels_as_a_file(launcher: LocalLauncher) -> None:
    spec = JobSpec.model_validate(
        {"name": "f", "task": "regression", "resources": {"nproc_per_node": 2}}
    )
    plan = launcher.plan(spec, 4, 2)
    assert set(plan.files) == {"spec.json"}
    assert JobSpec.model_validate_json(plan.files["spec.json"]) == spec


def test_allowed_entrypoints_are_passed_on(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, allowed_entrypoints=["tests.*:*"])
    env = LocalLauncher(settings).plan(JobSpec(name="x", task="regression"), 1, 1).env
    assert env["DDPQ_ALLOWED_ENTRYPOINTS"] == '["tests.*:*"]'


def test_gpu_plan_with_bound_gpus_matches_golden(launcher: LocalLauncher, tmp_path: Path) -> None:
    spec = JobSpec.model_validate(
        {
            "name": "golden-gpu",
            "task": "digits",
            "resources": {"nproc_per_node": 2, "gpus_per_node": 2},
        }
    )
    plan = launcher.bind_gpus(launcher.plan(spec, 12, 1), [2, 3])
    _check_golden("local_plan_gpu.txt", _normalise(plan.render(), tmp_path))


def test_plan_touches_nothing(launcher: LocalLauncher, tmp_path: Path) -> None:
    before = sorted(p.name for p in tmp_path.iterdir())
    launcher.plan(JobSpec(name="x", task="regression"), 1, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "plan() must not create files"


def test_unbound_gpu_job_sees_first_gpus_and_cpu_job_none(launcher: LocalLauncher) -> None:
    gpu = JobSpec.model_validate(
        {"name": "g", "task": "regression", "resources": {"gpus_per_node": 3}}
    )
    assert launcher.plan(gpu, 1, 1).env["CUDA_VISIBLE_DEVICES"] == "0,1,2"
    cpu = JobSpec(name="c", task="regression")
    assert launcher.plan(cpu, 1, 1).env["CUDA_VISIBLE_DEVICES"] == ""


def test_warm_ranks_off_plans_plain_torchrun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``DDPQ_WARM_RANKS=false``: the escape hatch to torchrun's own fresh rank processes."""
    settings = Settings(
        home=tmp_path / ".ddpq", database_url=f"sqlite:///{tmp_path}/ddpq.db", warm_ranks=False
    )
    plan = LocalLauncher(settings).plan(JobSpec(name="x", task="regression"), 1, 1)
    assert plan.argv[1:3] == ["-m", "torch.distributed.run"], plan.argv
    assert plan.argv[-2:] == ["-m", "worker.runtime"]
    monkeypatch.setenv("DDPQ_WARM_RANKS", "false")
    assert Settings().warm_ranks is False
