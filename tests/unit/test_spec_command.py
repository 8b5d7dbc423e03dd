"""Command jobs in the spec: ``command``, ``workspace`` and ``env`` are checked field by field,
exactly one of ``task`` and ``command`` is given, and a deployment that does not run users'
code says which setting changes that."""

from __future__ import annotations

from typing import Any

import pytest

from service.core.config import Settings
from service.core.errors import SpecValidationError
from service.core.spec.model import validate_spec
from service.core.spec.overrides import OverridePathError, apply_overrides
from worker.attempt import rank_env

DIGEST = "ab" * 32
ALLOW = Settings(user_code="allow")
OK: dict[str, Any] = {"name": "tutorial", "command": ["train.py", "--epochs", "3"],
                      "workspace": DIGEST}  # fmt: skip


def _errors(data: dict[str, Any], settings: Settings = ALLOW) -> list[tuple[list[Any], str]]:
    with pytest.raises(SpecValidationError) as info:
        validate_spec(data, settings)
    return [(e["loc"], e["msg"]) for e in info.value.errors]


def test_a_command_job_validates_and_keeps_its_fields() -> None:
    spec = validate_spec({**OK, "env": {"LR": "0.1"}}, ALLOW)
    assert spec.is_command and not spec.is_builtin_task and spec.task is None
    assert spec.command == ["train.py", "--epochs", "3"] and spec.workspace == DIGEST
    assert spec.env == {"LR": "0.1"}


def test_module_commands_and_numbers_from_sweep_axes() -> None:
    spec = validate_spec({**OK, "command": ["-m", "pkg.train", 3], "env": {"LR": 1e-3}}, ALLOW)
    assert spec.command == ["-m", "pkg.train", "3"] and spec.env == {"LR": "0.001"}


@pytest.mark.parametrize(
    ("patch", "field", "needle"),
    [
        ({"command": None}, "task", "give a task"),
        ({"task": "digits"}, "command", "not both"),
        ({"workspace": None}, "workspace", "runs in a workspace"),
        ({"command": ["python", "train.py"]}, "command", "starts python and torchrun itself"),
        ({"command": ["torchrun", "train.py"]}, "command", "starts python and torchrun itself"),
        ({"command": ["--nproc-per-node", "2", "t.py"]}, "command", "torchrun's options"),
        ({"command": ["../train.py"]}, "command", "'..' part"),
        ({"command": ["/abs/train.py"]}, "command", "absolute"),
        ({"command": ["-m"]}, "command", "module name"),
        ({"command": ["-m", "not a module"]}, "command", "module name"),
        ({"command": []}, "command", "at least 1"),
        ({"command": ["a\x00b.py"]}, "command", "NUL"),
        ({"workspace": "not-a-digest"}, "workspace", "pattern"),
    ],
)
def test_each_bad_command_field_is_named(patch: dict[str, Any], field: str, needle: str) -> None:
    data = {k: v for k, v in {**OK, **patch}.items() if v is not None}
    errors = _errors(data)
    assert any(loc[:2] == ["body", field] and needle in msg for loc, msg in errors), errors


def test_a_workspace_without_a_command_is_refused() -> None:
    errors = _errors({"name": "x", "task": "digits", "workspace": DIGEST})
    assert (["body", "workspace"], "a workspace is for a command job: give command too") in errors


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("DDPQ_ATTEMPT_TOKEN", "ddpq's own"),
        ("ddpq_api_url", "ddpq's own"),
        ("RANK", "torchrun sets"),
        ("MASTER_PORT", "torchrun sets"),
        ("1LR", "not a variable name"),
        ("LR-X", "not a variable name"),
    ],
)
def test_env_names_ddpq_or_torchrun_own_are_refused(name: str, needle: str) -> None:
    errors = _errors({**OK, "env": {name: "1"}})
    assert any(loc[:3] == ["body", "env", name] and needle in msg for loc, msg in errors), errors


def test_env_values_are_text() -> None:
    errors = _errors({**OK, "env": {"LR": {"nested": 1}}})
    assert any(loc[:3] == ["body", "env", "LR"] for loc, _ in errors), errors


def test_deny_names_the_setting_and_auth_on_denies_by_default() -> None:
    for settings in (Settings(user_code="deny"), Settings(user_code="auto", auth="on")):
        errors = _errors(OK, settings)
        assert any(loc == ["body", "command"] and "DDPQ_USER_CODE=allow" in msg
                   for loc, msg in errors), errors  # fmt: skip
    assert Settings(user_code="auto", auth="off").user_code_allowed
    assert not Settings(user_code="auto", auth="on").user_code_allowed
    assert Settings(user_code="allow", auth="on").user_code_allowed


@pytest.mark.parametrize(
    "training",
    [{"lr": 0.1}, {"batch_size": 64}, {"epochs": 3}, {"optimizer": "sgd"}, {"amp": False}],
)
def test_training_fields_of_the_builtin_loop_are_refused_for_a_command_job(
    training: dict[str, Any],
) -> None:
    [field] = training
    errors = _errors({**OK, "training": training})
    assert any(
        loc == ["body", "training", field]
        and f"training.{field} applies to the built-in tasks" in msg
        and "never reads it" in msg
        for loc, msg in errors
    ), errors
    # The same value is a task's to use.
    assert validate_spec({"name": "t", "task": "regression", "training": training}, ALLOW)
    # A command sweep stored before the rule is extended as it is (its base cannot be edited).
    assert validate_spec({**OK, "training": training}, ALLOW, stored=True)


def test_training_fields_a_command_job_uses_and_a_stored_spec_stay_valid() -> None:
    used = {"seed": 3, "max_steps": 50, "keep_checkpoints": 100, "nonfinite_loss": "skip_step"}
    spec = validate_spec({**OK, "training": used}, ALLOW)
    assert spec.training.keep_checkpoints == 100 and spec.training.seed == 3
    # A stored spec holds every training field (at its default): it validates again, so a
    # clone or a sweep's extend of an existing command job still goes through.
    stored = spec.model_dump(mode="json")
    assert stored["training"]["lr"] == 1e-3
    assert validate_spec(stored, ALLOW) == spec


def test_a_sweep_axis_or_set_replaces_a_command_item_by_index() -> None:
    spec = apply_overrides(OK, {"command.2": "5", "env.LR": "0.01"})
    assert spec["command"] == ["train.py", "--epochs", "5"] and spec["env"] == {"LR": "0.01"}
    assert OK["command"][2] == "3", "the base spec is not changed"
    refused = [
        ("command.3", "past it"),
        ("command.x", "is a list"),
        ("name.1", "not an object"),
        ("training.1", "not a field name"),
    ]
    for path, needle in refused:
        with pytest.raises(OverridePathError, match=needle):
            apply_overrides({**OK, "training": {}}, {path: "1"})


def test_the_spec_env_reaches_the_ranks_but_never_over_ddpq_own() -> None:
    env = rank_env(7, 2, artifact_dir="/a", cpus_per_task=4, user_env={"LR": "0.1",
                   "OMP_NUM_THREADS": "8"})  # fmt: skip
    assert env["LR"] == "0.1" and env["OMP_NUM_THREADS"] == "8"
    assert env["DDPQ_JOB_ID"] == "7" and env["DDPQ_ATTEMPT"] == "2"
    assert env["DDPQ_CHECKPOINT_DIR"] == "/a/jobs/7/checkpoints"
