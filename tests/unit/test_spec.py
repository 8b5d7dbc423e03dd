"""The spec validation table: each bad spec names its field; good specs are normalised."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.core.config import Settings
from service.core.errors import SpecValidationError
from service.core.spec.model import JobSpec, validate_spec

SETTINGS = Settings(allowed_entrypoints=["examples.*:*"], max_nproc_per_node=8)
OK: dict[str, Any] = {"name": "digits-2", "task": "digits"}


def _nested(levels: int) -> Any:
    """``[[...[1]...]]``: ``levels`` arrays around a 1."""
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


def _errors(data: Any, settings: Settings = SETTINGS) -> list[dict[str, Any]]:
    with pytest.raises(SpecValidationError) as info:
        validate_spec(data, settings)
    return info.value.errors


@pytest.mark.parametrize(
    ("patch", "loc", "needle"),
    [
        ({"name": ""}, ["body", "name"], "at least 1"),
        ({"name": "x" * 201}, ["body", "name"], "at most 200"),
        ({"task": "nope"}, ["body", "task"], "built-in task"),
        ({"task": "os:system"}, ["body", "task"], "allow-list"),
        ({"launcher": "k8s"}, ["body", "launcher"], "local"),
        ({"launcher": "slurm"}, ["body", "launcher"], "no Slurm"),
        ({"zzz": 1}, ["body", "zzz"], "Extra inputs"),
        (
            {"resources": {"nproc_per_node": 0}},
            ["body", "resources", "nproc_per_node"],
            "greater than or equal to 1",
        ),
        ({"resources": {"nproc_per_node": 9}}, ["body", "resources", "nproc_per_node"], "cap"),
        ({"resources": {"nnodes": 2}}, ["body", "resources", "nnodes"], "one host"),
        ({"backend": "nccl"}, ["body", "backend"], "needs GPUs"),
        (
            {"backend": "nccl", "resources": {"nproc_per_node": 2, "gpus_per_node": 1}},
            ["body", "resources", "nproc_per_node"],
            "one GPU per rank",
        ),
        ({"strategy": "dp", "resources": {"nproc_per_node": 2}}, ["body", "strategy"], "one"),
        ({"config": {"model": "rnn"}}, ["body", "config", "model"], "pattern"),
        ({"config": {"bogus": 1}}, ["body", "config", "bogus"], "Extra inputs"),
        (
            {"training": {"checkpoint_every_steps": 5, "checkpoint_every_epochs": 1}},
            ["body", "training"],
            "not both",
        ),
        ({"training": {"lr": 0}}, ["body", "training", "lr"], "greater than 0"),
        ({"slurm": {"partition": "gpu"}}, ["body", "slurm"], "only to launcher"),
    ],
)
def test_bad_spec_names_the_field(patch: dict[str, Any], loc: list[str], needle: str) -> None:
    errors = _errors({**OK, **patch})
    assert any(e["loc"] == loc and needle in e["msg"] for e in errors), errors


def test_not_an_object_is_rejected() -> None:
    assert _errors([1, 2])[0]["loc"] == ["body"]


def test_every_problem_reported_at_once() -> None:
    errors = _errors({**OK, "backend": "nccl", "config": {"model": "rnn"}})
    assert {tuple(e["loc"]) for e in errors} == {("body", "backend"), ("body", "config", "model")}


def test_good_spec_fills_task_defaults_and_is_frozen() -> None:
    spec = validate_spec({**OK, "resources": {"nproc_per_node": 2}}, SETTINGS)
    assert spec.config["model"] == "cnn"
    assert spec.resolved_backend == "gloo"
    assert spec.resources.world_size == 2
    with pytest.raises(ValueError):
        spec.name = "other"  # type: ignore[misc]


def test_gpu_job_resolves_to_nccl() -> None:
    spec = validate_spec({**OK, "resources": {"nproc_per_node": 2, "gpus_per_node": 2}}, SETTINGS)
    assert spec.resolved_backend == "nccl"


def test_allowed_entrypoint_and_slurm_when_enabled() -> None:
    settings = Settings(allowed_entrypoints=["examples.*:*"], slurm_enabled=True)
    spec = validate_spec(
        {
            "name": "e",
            "task": "examples.custom_loop:train",
            "launcher": "slurm",
            "resources": {"nnodes": 2},
            "slurm": {"partition": "debug"},
        },
        settings,
    )
    assert spec.launcher == "slurm" and not spec.is_builtin_task


def test_stored_spec_round_trips() -> None:
    spec = validate_spec({**OK, "tags": ["a"]}, SETTINGS)
    again = JobSpec.model_validate(spec.model_dump(mode="json"))
    assert again == spec


@pytest.mark.parametrize(
    ("patch", "loc", "hint"),
    [
        (
            {"resources": {"nproc_per_nod": 2}},
            ["body", "resources", "nproc_per_nod"],
            "'nproc_per_node'",
        ),
        ({"trainig": {}}, ["body", "trainig"], "'training'"),
        ({"training": {"learning_rate": 1}}, ["body", "training", "learning_rate"], None),
        ({"config": {"hiden": 8}}, ["body", "config", "hiden"], "'hidden'"),
        ({"task": "charlm", "config": {"n_head": 2}}, ["body", "config", "n_head"], "'n_heads'"),
        (
            {"launcher": "slurm", "slurm": {"partiton": "gpu"}},
            ["body", "slurm", "partiton"],
            "'partition'",
        ),
        # A top-level name that is a nested field's: the dotted path, even where a top-level
        # name is close (checkpoint_every_steps is not 'checkpoints').
        ({"timeout_min": 5}, ["body", "timeout_min"], "'resources.timeout_min'"),
        ({"lr": 0.1}, ["body", "lr"], "'training.lr'"),
        (
            {"checkpoint_every_steps": 5},
            ["body", "checkpoint_every_steps"],
            "'training.checkpoint_every_steps'",
        ),
        ({"timeout": 5}, ["body", "timeout"], "'resources.timeout_min'"),
    ],
)
def test_unknown_field_suggests_the_closest_valid_one(
    patch: dict[str, Any], loc: list[str], hint: str | None
) -> None:
    settings = Settings(slurm_enabled=True)
    [error] = [e for e in _errors({**OK, **patch}, settings) if e["loc"] == loc]
    assert error["type"] == "extra_forbidden"
    if hint is not None:
        assert error["msg"].endswith(f"did you mean {hint}?"), error["msg"]
    else:  # nothing close: list what is valid
        assert "valid fields: epochs, max_steps, batch_size, lr," in error["msg"], error["msg"]


def test_unknown_top_level_field_lists_the_valid_ones() -> None:
    [error] = _errors({**OK, "colour": "red"})
    assert "valid fields: name, task, config, launcher, resources" in error["msg"], error["msg"]


def test_caps_and_config_errors_come_with_pydantic_errors_in_one_round() -> None:
    errors = _errors(
        {**OK, "strategy": "fsdp", "resources": {"nproc_per_node": 200}, "config": {"x": 1}}
    )
    locs = {tuple(e["loc"]) for e in errors}
    assert locs == {
        ("body", "strategy"),
        ("body", "resources", "nproc_per_node"),
        ("body", "config", "x"),
    }, errors
    cap = next(e for e in errors if e["loc"][-1] == "nproc_per_node")
    assert "exceeds this deployment's cap of 8" in cap["msg"]


def test_settings_rules_join_pydantic_errors_and_skip_values_of_the_wrong_type() -> None:
    errors = _errors(
        {
            "name": "",
            "task": "os:system",
            "launcher": "slurm",
            "resources": {"nnodes": "many", "nproc_per_node": True, "gpus_per_node": 99},
        }
    )
    by_loc = {tuple(e["loc"]): e["msg"] for e in errors}
    assert "allow-list" in by_loc[("body", "task")]
    assert "no Slurm" in by_loc[("body", "launcher")]
    assert "cap of 16" in by_loc[("body", "resources", "gpus_per_node")]
    assert "cap" not in by_loc[("body", "resources", "nnodes")], "pydantic's type error only"
    assert ("body", "resources", "nproc_per_node") not in by_loc
    assert ("body", "name") in by_loc


def test_caps_apply_to_values_pydantic_coerced() -> None:
    errors = _errors({**OK, "resources": {"nproc_per_node": "9", "nnodes": 1.0}})
    assert [e["loc"] for e in errors] == [["body", "resources", "nproc_per_node"]], errors


def test_world_size_is_one_for_dp() -> None:
    assert validate_spec({**OK, "strategy": "dp"}, SETTINGS).world_size == 1
    assert validate_spec({**OK, "resources": {"nproc_per_node": 2}}, SETTINGS).world_size == 2


ENTRY: dict[str, Any] = {"name": "e", "task": "examples.custom_loop:train"}


@pytest.mark.parametrize(
    ("data", "loc", "needle"),
    [
        ({**OK, "tags": ["ok", "\ud800"]}, ["body", "tags", 1], "lone surrogate \\ud800"),
        ({**OK, "name": "a\udcffb"}, ["body", "name"], "lone surrogate"),
        ({**ENTRY, "config": {"d": {"x": ["\ud83d"]}}}, ["body", "config", "d", "x", 0], "Unicode"),
        ({**ENTRY, "config": {"k\ud800": 1}}, ["body", "config", "k\\ud800"], "field name"),
        ({**ENTRY, "config": {"k\x00": 1}}, ["body", "config", "k\\x00"], "NUL"),
        ({**ENTRY, "config": {"v": "a\x00"}}, ["body", "config", "v"], "NUL"),
        (
            {**ENTRY, "launcher": "slurm", "slurm": {"extra": {"gres": "gpu\ud800"}}},
            ["body", "slurm", "extra", "gres"],
            "surrogate",
        ),
        ({**ENTRY, "config": {"lr": float("nan")}}, ["body", "config", "lr"], "finite"),
        ({**ENTRY, "config": {"a": [1, float("-inf")]}}, ["body", "config", "a", 1], "finite"),
        ({**OK, "resources": {"mem_gb": float("inf")}}, ["body", "resources", "mem_gb"], "finite"),
        ({**OK, "resources": {"mem_gb": "Infinity"}}, ["body", "resources", "mem_gb"], "finite"),
        ({**OK, "training": {"lr": float("nan")}}, ["body", "training", "lr"], "finite"),
        (
            {**ENTRY, "config": {"d": _nested(60)}},
            ["body", "config", "d", *[0] * 48],  # spec, config, d: levels 1-3
            "nested deeper than 50",
        ),
    ],
    ids=[
        "surrogate tag", "surrogate name", "nested config value", "config key", "NUL key",
        "NUL config value", "slurm extra", "NaN config", "-inf in list", "inf mem_gb",
        "Infinity string", "NaN lr", "deep config",
    ],
)  # fmt: skip
def test_text_and_numbers_json_cannot_carry_are_refused_naming_the_field(
    data: dict[str, Any], loc: list[Any], needle: str
) -> None:
    settings = Settings(allowed_entrypoints=["examples.*:*"], slurm_enabled=True)
    errors = _errors(data, settings)
    assert any(e["loc"] == loc and needle in e["msg"] for e in errors), errors
    # The errors themselves are plain UTF-8 JSON: no surrogate or NUL is echoed back.
    json.dumps(errors, ensure_ascii=False).encode("utf-8")
    assert "\x00" not in json.dumps(errors, ensure_ascii=False)


def test_one_error_per_field_and_no_confusing_duplicates() -> None:
    errors = _errors({**OK, "\ud800": 1, "resources": {"mem_gb": float("nan")}})
    locs = [tuple(e["loc"]) for e in errors]
    assert len(locs) == len(set(locs)), errors
    assert ("body",) not in locs, "pydantic's own unicode error is replaced by the field's"


def test_cpus_and_memory_are_capped() -> None:
    errors = _errors({**OK, "resources": {"cpus_per_task": 10**40, "mem_gb": 5000}})
    by_loc = {tuple(e["loc"]): e["msg"] for e in errors}
    assert "cap of 256" in by_loc[("body", "resources", "cpus_per_task")], errors
    assert "cap of 4096" in by_loc[("body", "resources", "mem_gb")], errors
    small = Settings(max_cpus_per_task=4, max_mem_gb=8)
    assert validate_spec({**OK, "resources": {"cpus_per_task": 4, "mem_gb": 8}}, small)
    assert [e["loc"] for e in _errors({**OK, "resources": {"cpus_per_task": 5}}, small)] == [
        ["body", "resources", "cpus_per_task"]
    ]
    [mem] = _errors({**OK, "resources": {"mem_gb": 8.5}}, small)
    assert mem["loc"] == ["body", "resources", "mem_gb"] and "cap of 8" in mem["msg"]


def test_stall_timeout_and_nonfinite_policy_have_safe_defaults() -> None:
    spec = validate_spec(OK, Settings())
    assert spec.training.stall_timeout_s == 1800, "30 min: sane for hours-long jobs"
    assert spec.training.nonfinite_loss == "fail"
    custom = {**OK, "training": {"stall_timeout_s": 10, "nonfinite_loss": "skip_step"}}
    training = validate_spec(custom, Settings()).training
    assert training.stall_timeout_s == 10 and training.nonfinite_loss == "skip_step"


@pytest.mark.parametrize(
    ("training", "needle"),
    [
        ({"stall_timeout_s": 9}, "greater than or equal to 10"),
        ({"stall_timeout_s": 7 * 24 * 3600 + 1}, "less than or equal to 604800"),
        ({"stall_timeout_s": "soon"}, "valid integer"),
        ({"nonfinite_loss": "ignore"}, "'fail' or 'skip_step'"),
    ],
)
def test_bad_stall_timeout_or_nonfinite_policy_names_the_field(
    training: dict[str, Any], needle: str
) -> None:
    [error] = _errors({**OK, "training": training})
    field = next(iter(training))
    assert error["loc"] == ["body", "training", field] and needle in error["msg"], error


def test_unknown_task_is_reported_with_other_field_errors_and_a_hint() -> None:
    errors = _errors({"name": "x", "task": "digitz", "resources": {"nproc_per_node": "two"}})
    by_loc = {tuple(e["loc"]): e["msg"] for e in errors}
    assert set(by_loc) == {("body", "task"), ("body", "resources", "nproc_per_node")}, errors
    assert "did you mean 'digits'?" in by_loc[("body", "task")]


def test_a_fault_knob_naming_a_rank_the_job_lacks_is_refused() -> None:
    spec = {"name": "x", "task": "regression", "resources": {"nproc_per_node": 2}}
    errors = _errors({**spec, "config": {"hang_rank": 2, "hang_at_step": 3}})
    assert [(e["loc"], e["msg"]) for e in errors] == [
        (
            ["body", "config", "hang_rank"],
            "hang_rank=2 but the job has 2 rank(s), 0–1; the fault would never fire",
        )
    ]
    validate_spec({**spec, "config": {"hang_rank": 1, "hang_at_step": 3}}, SETTINGS)
