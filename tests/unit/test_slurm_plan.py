"""The Slurm launcher's plan (the rendered sbatch script, golden files) and the rank-side
translation of Slurm's variables. No Slurm needed.

Regenerate the golden files after an intended change:
``DDPQ_UPDATE_GOLDEN=1 pytest tests/unit/test_slurm_plan.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

from service.core import artifacts
from service.core.config import Settings
from service.core.spec.model import JobSpec
from worker.errors import LaunchError
from worker.launchers.base import mask_text, with_attempt_token
from worker.launchers.slurm.launcher import SlurmLauncher
from worker.launchers.slurm.rank import (
    MASTER_PORT_BASE,
    MASTER_PORT_SPAN,
    SlurmTopologyError,
    first_node,
    master_port_for,
    parse_time_left,
    resolve_node_address,
    topology_from_slurm,
)

GOLDEN = Path(__file__).parents[1] / "golden"


def _settings(tmp_path: Path) -> Settings:
    return Settings(
        home=tmp_path / ".ddpq",
        database_url=f"sqlite:///{tmp_path}/ddpq.db",
        artifact_dir=tmp_path / "artifacts",
        slurm_enabled=True,
        api_url="http://api.example:8000",
    )


def _normalise(text: str, tmp_path: Path) -> str:
    return text.replace(str(tmp_path.resolve()), "<tmp>").replace(sys.executable, "<python>")


def _check_golden(name: str, text: str) -> None:
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


@pytest.fixture
def launcher(tmp_path: Path) -> SlurmLauncher:
    (tmp_path / "cwd").mkdir()
    return SlurmLauncher(_settings(tmp_path), cwd=tmp_path / "cwd")


def _spec(**overrides: object) -> JobSpec:
    data: dict[str, object] = {"name": "golden", "task": "regression", "launcher": "slurm"}
    data.update(overrides)
    return JobSpec.model_validate(data)


def test_one_node_two_ranks_plan_matches_golden(launcher: SlurmLauncher, tmp_path: Path) -> None:
    spec = _spec(resources={"nproc_per_node": 2, "cpus_per_task": 1, "timeout_min": 5})
    plan = with_attempt_token(launcher.plan(spec, 7, 1), "ddpqa_s3cret-token")
    _check_golden("slurm_plan_1x2.txt", _normalise(plan.render(), tmp_path))
    assert "s3cret" not in plan.render() and "s3cret" not in (plan.script or "")
    assert plan.launcher == "slurm" and plan.argv == ["sbatch"]
    assert plan.request is not None
    assert plan.request.folder == str(artifacts.slurm_dir(tmp_path / "artifacts", 7, 1))


def test_two_nodes_with_gpus_and_placement_matches_golden(
    launcher: SlurmLauncher, tmp_path: Path
) -> None:
    spec = _spec(
        resources={
            "nnodes": 2,
            "nproc_per_node": 2,
            "gpus_per_node": 2,
            "cpus_per_task": 4,
            "mem_gb": 1.5,
            "timeout_min": 120,
        },
        slurm={
            "partition": "gpu",
            "account": "ml",
            "qos": "high",
            "constraint": "a100&ib",
            "time_limit_min": 90,
            "extra": {"mail_type": "END", "--exclusive": "user"},
        },
    )
    plan = launcher.plan(spec, 12, 3)
    _check_golden("slurm_plan_2x2_gpu.txt", _normalise(plan.render(), tmp_path))


def test_plan_has_one_task_per_rank_and_the_preemption_warning(launcher: SlurmLauncher) -> None:
    spec = _spec(resources={"nnodes": 3, "nproc_per_node": 4, "timeout_min": 30})
    script = launcher.plan(spec, 5, 2).script or ""
    assert "#SBATCH --nodes=3" in script
    assert "#SBATCH --ntasks-per-node=4" in script
    assert "#SBATCH --signal=USR1@60" in script
    assert "#SBATCH --time=30" in script
    assert "#SBATCH --job-name=ddpq-5-2" in script
    assert "export DDPQ_ATTEMPT=2" in script


def test_database_url_never_appears_in_the_script(tmp_path: Path) -> None:
    settings = Settings(
        database_url="postgresql+psycopg://ddpq:s3cret@db.example/ddpq",
        artifact_dir=tmp_path / "artifacts",
        slurm_enabled=True,
    )
    plan = SlurmLauncher(settings, cwd=tmp_path).plan(_spec(), 1, 1)
    assert "s3cret" not in plan.render()
    assert plan.request is not None
    assert "s3cret" not in json.dumps(dataclasses.asdict(plan.request))


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://apiuser:PlainPw123@10.0.0.5:8765", "http://apiuser:***@10.0.0.5:8765"),
        ("http://apiuser:p@ss:w0rd@10.0.0.5:8765/x", "http://apiuser:***@10.0.0.5:8765/x"),
        ("https://me@corp:s3@cret@api.example", "https://me@corp:***@api.example"),
    ],
)
def test_the_api_urls_password_is_masked_in_the_script_and_the_log(
    tmp_path: Path, url: str, shown: str
) -> None:
    settings = _settings(tmp_path).model_copy(update={"api_url": url})
    (tmp_path / "cwd").mkdir()
    plan = with_attempt_token(
        SlurmLauncher(settings, cwd=tmp_path / "cwd").plan(_spec(), 1, 1), "ddpqa_s3cret-token"
    )
    # The worker logs exactly ``render()``; the script submitit submits keeps the real URL.
    text = plan.render()
    password = url.split("://")[1].split(":", 1)[1].rsplit("@", 1)[0]
    assert password not in text and "s3cret" not in text
    assert f"export DDPQ_API_URL={shown}" in text.split("#!/bin/bash", 1)[1], "in the script"
    assert f"export DDPQ_API_URL={shown}" in text.split("#!/bin/bash", 1)[0], "in the env"
    assert url in (plan.script or "")
    # The attempt token is masked wherever it appears, the script included.
    leaky = dataclasses.replace(plan, script=f"{plan.script}\necho ddpqa_s3cret-token\n")
    assert "ddpqa_s3cret-token" not in leaky.render()
    assert mask_text("see http://u:a@b@h and tok", ["tok"]) == "see http://u:***@h and ***"


def test_default_partition_applies_only_when_the_spec_names_none(tmp_path: Path) -> None:
    launcher = SlurmLauncher(_settings(tmp_path), cwd=tmp_path, partition="cpu")
    assert "#SBATCH --partition=cpu" in (launcher.plan(_spec(), 1, 1).script or "")
    named = launcher.plan(_spec(slurm={"partition": "gpu"}), 1, 1).script or ""
    assert "#SBATCH --partition=gpu" in named and "--partition=cpu" not in named


@pytest.mark.parametrize("key", ["signal", "--job-name", "ntasks_per_node", "output"])
def test_extra_options_may_not_override_what_ddpq_sets(launcher: SlurmLauncher, key: str) -> None:
    with pytest.raises(LaunchError, match="reserved"):
        launcher.plan(_spec(slurm={"extra": {key: "x"}}), 1, 1)


def test_plan_touches_nothing(launcher: SlurmLauncher, tmp_path: Path) -> None:
    launcher.plan(_spec(), 1, 1)
    assert not (tmp_path / "artifacts").exists()


# -- inside a Slurm task ----------------------------------------------------------------------

SLURM_TASK_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NTASKS": "4",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_NODELIST": "ddpq-n[1-2]",
}


def test_topology_from_slurm_variables() -> None:
    assert topology_from_slurm(SLURM_TASK_ENV) == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "ddpq-n1",
        "MASTER_PORT": str(MASTER_PORT_BASE + 4242),
    }


@pytest.mark.parametrize("missing", ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_NODELIST"])
def test_topology_needs_slurm_variables(missing: str) -> None:
    env = {k: v for k, v in SLURM_TASK_ENV.items() if k != missing}
    with pytest.raises(SlurmTopologyError, match=missing):
        topology_from_slurm(env)


def test_master_ports_differ_for_concurrent_jobs_and_stay_in_band() -> None:
    ports = {master_port_for(str(i)) for i in range(1000, 1000 + MASTER_PORT_SPAN)}
    assert len(ports) == MASTER_PORT_SPAN
    assert min(ports) >= MASTER_PORT_BASE and max(ports) < 32768  # below the ephemeral range
    assert master_port_for("77_3") == master_port_for("77")
    with pytest.raises(SlurmTopologyError):
        master_port_for("abc")


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [("ddpq-n[1-2]", "ddpq-n1"), ("gpu[07-09],cpu1", "gpu07"), ("localhost", "localhost")],
)
def test_first_node_of_a_nodelist(nodelist: str, first: str) -> None:
    assert first_node(nodelist) == first


def test_a_resolvable_node_name_is_its_own_address() -> None:
    assert resolve_node_address("localhost") == "localhost"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("0:45", 45.0),
        ("10:00", 600.0),
        ("1:00:00", 3600.0),
        ("2-03:00:01", 2 * 86400 + 3 * 3600 + 1.0),
        ("UNLIMITED", None),
        ("", None),
    ],
)
def test_parse_time_left(text: str, seconds: float | None) -> None:
    assert parse_time_left(text) == seconds
