"""The launcher traits table and the registry: one set of names, lazily imported classes that
build themselves from settings, GPU binding as a launcher method."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.core.config import Settings
from service.core.launchers import (
    LAUNCHER_TRAITS,
    Traits,
    adopting_launchers,
    launcher_names,
    launcher_traits,
    multi_node_launchers,
    uses_host_gpus,
)
from service.core.spec.model import JobSpec
from worker.errors import LaunchError
from worker.launchers import registry
from worker.launchers.base import LaunchPlan


def test_the_spec_the_openapi_enum_and_the_registry_read_the_traits_table() -> None:
    names = set(LAUNCHER_TRAITS)
    enum = JobSpec.model_json_schema()["properties"]["launcher"]["enum"]
    assert set(enum) == names, "the OpenAPI enum lists exactly LAUNCHER_TRAITS' keys"
    for name in names:
        assert JobSpec(name="j", task="regression", launcher=name).launcher == name
        assert LAUNCHER_TRAITS[name].implementation, f"{name} names its class"
    with pytest.raises(ValidationError, match="unknown launcher 'k8s'; choose one of: local"):
        JobSpec(name="j", task="regression", launcher="k8s")


def test_traits_of_the_built_in_launchers() -> None:
    assert launcher_names() == ("local", "slurm")
    assert launcher_traits("local") == Traits(
        host_gpus=True, detached=False, adopts=False, multi_node=False, title="local",
        implementation="worker.launchers.local.launcher:LocalLauncher",
    )  # fmt: skip
    assert launcher_traits("slurm") == Traits(
        host_gpus=False, detached=True, adopts=True, multi_node=True, title="Slurm",
        implementation="worker.launchers.slurm.launcher:SlurmLauncher",
    )  # fmt: skip
    assert adopting_launchers() == ("slurm",) and multi_node_launchers() == ("slurm",)
    assert uses_host_gpus("local") and not uses_host_gpus("slurm")
    assert not uses_host_gpus("k8s"), "an unknown launcher hands out no host GPUs"
    with pytest.raises(KeyError, match="choose one of: local, slurm"):
        launcher_traits("k8s")
    with pytest.raises(ValueError, match="must be detached"):
        Traits(host_gpus=False, detached=False, adopts=True, multi_node=False)


def test_make_launcher_builds_each_class_from_settings(tmp_path: Path) -> None:
    settings = Settings(
        home=tmp_path,
        database_url=f"sqlite:///{tmp_path / 'x.db'}",
        slurm_partition="debug",
        slurm_signal_delay_s=77,
    )
    local = registry.make_launcher("local", settings)
    assert type(local).__name__ == "LocalLauncher" and local.name == "local"
    slurm = registry.make_launcher("slurm", settings)
    assert type(slurm).__name__ == "SlurmLauncher" and slurm.name == "slurm"
    assert (slurm.partition, slurm.signal_delay_s) == ("debug", 77)  # type: ignore[attr-defined]
    assert slurm.python == (settings.slurm_python or sys.executable)  # type: ignore[attr-defined]
    with pytest.raises(LaunchError, match="unknown launcher 'k8s'; choose one of: local, slurm"):
        registry.make_launcher("k8s", settings)


def test_bind_gpus_is_the_launchers_business(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'x.db'}")
    spec = JobSpec(name="x", task="regression")
    local = registry.make_launcher("local", settings)
    bound = local.bind_gpus(local.plan(spec, 3, 1), [2, 3])
    assert bound.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    slurm = registry.make_launcher("slurm", settings)
    plan: LaunchPlan[object] = LaunchPlan("slurm", 3, 1, ["sbatch"], {}, "/", "/tmp")
    assert slurm.bind_gpus(plan, [0]) is plan, "Slurm places GPUs itself"
