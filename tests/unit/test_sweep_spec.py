"""Sweep expansion, trial keys, dotted-path overrides and extend merging (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from service.core.config import Settings
from service.core.errors import SpecValidationError
from service.core.spec.overrides import OverridePathError, apply_overrides, parse_assignment
from service.core.sweeps.spec import (
    SweepExtension,
    SweepSpec,
    expand_overrides,
    extended_spec,
    plan_trials,
    resolve_objective,
    trial_key,
)

BASE: dict[str, Any] = {"name": "b", "task": "regression", "training": {"max_steps": 5}}


def sweep(**changes: Any) -> SweepSpec:
    return SweepSpec.model_validate({"name": "s", "base": BASE, **changes})


def test_grid_times_seeds_in_order_with_the_seed_in_every_key() -> None:
    spec = sweep(
        axes={"training.lr": {"grid": [0.1, 0.2]}, "config.hidden": {"grid": [8, 16]}}, seeds=2
    )
    got = expand_overrides(spec)
    assert len(got) == 8
    assert got[0] == {"training.lr": 0.1, "config.hidden": 8, "training.seed": 0}
    assert got[1] == {"training.lr": 0.1, "config.hidden": 8, "training.seed": 1}
    assert got[-1] == {"training.lr": 0.2, "config.hidden": 16, "training.seed": 1}
    assert len({trial_key(o) for o in got}) == 8, "every trial has its own key"


def test_key_is_canonical_json_whatever_the_order() -> None:
    assert trial_key({"a": 1, "b": 2.5}) == trial_key({"b": 2.5, "a": 1})
    assert trial_key({"a": 1}) != trial_key({"a": 2})


def test_random_draws_are_seeded_in_range_and_stable_under_more_samples() -> None:
    spec = sweep(axes={"training.lr": {"loguniform": [1e-4, 1e-1]}}, samples=5)
    first = expand_overrides(spec)
    assert first == expand_overrides(spec), "the same spec draws the same values"
    assert all(1e-4 <= o["training.lr"] <= 1e-1 for o in first)
    more = expand_overrides(extended_spec(spec, SweepExtension(samples=8)))
    assert more[:5] == first, "more samples keep the earlier draws (and keys)"
    other = expand_overrides(sweep(axes=spec.model_dump()["axes"], samples=5, sampler_seed=1))
    assert other != first, "another sampler_seed draws other values"


def test_extend_adds_values_and_refuses_new_axes_or_fewer_samples() -> None:
    spec = sweep(axes={"training.lr": {"grid": [0.1, 0.2]}})
    ext = extended_spec(
        spec, SweepExtension.model_validate({"axes": {"training.lr": {"grid": [0.2, 0.3]}}})
    )
    assert ext.model_dump()["axes"]["training.lr"]["grid"] == [0.1, 0.2, 0.3]
    old = {trial_key(o) for o in expand_overrides(spec)}
    new = [o for o in expand_overrides(ext) if trial_key(o) not in old]
    assert new == [{"training.lr": 0.3, "training.seed": 0}], "only the new value is new"
    with pytest.raises(SpecValidationError, match="not an axis"):
        extended_spec(
            spec, SweepExtension.model_validate({"axes": {"config.hidden": {"grid": [1]}}})
        )
    with pytest.raises(SpecValidationError, match="never removed"):
        extended_spec(
            sweep(axes={"training.lr": {"uniform": [0.1, 1]}}, samples=3), SweepExtension(samples=2)
        )


def test_plan_names_the_trial_and_field_of_every_bad_value(tmp_path: Any) -> None:
    settings = Settings(home=tmp_path)
    spec = sweep(axes={"training.lr": {"grid": [0.1, -1.0]}})
    with pytest.raises(SpecValidationError) as info:
        plan_trials(spec, settings)
    (error,) = info.value.errors
    assert error["loc"] == ["body", "trials", 1, "training.lr"]
    assert "trial 1" in error["msg"] and "-1.0" in error["msg"]
    with pytest.raises(SpecValidationError) as info:
        plan_trials(sweep(axes={"training..lr": {"grid": [1]}}), settings)
    assert info.value.errors[0]["loc"] == ["body", "axes", "training..lr"]
    with pytest.raises(SpecValidationError) as info:
        plan_trials(sweep(base={**BASE, "task": "nope"}), settings)
    assert info.value.errors[0]["loc"] == ["body", "base", "task"]
    planned = plan_trials(sweep(axes={"config.hidden": {"grid": [8, 16]}}), settings)
    assert [t.spec.config["hidden"] for t in planned] == [8, 16]
    assert [t.spec.name for t in planned] == ["s-0", "s-1"]


def test_samples_without_random_axes_and_seed_conflicts_are_refused() -> None:
    with pytest.raises(SpecValidationError, match="no"):
        expand_overrides(sweep(samples=3))
    with pytest.raises(SpecValidationError, match="axis already"):
        expand_overrides(sweep(axes={"training.seed": {"grid": [1, 2]}}, seeds=2))


def test_objective_defaults_follow_the_task() -> None:
    assert resolve_objective(sweep()).as_dict() == {"metric": "loss", "mode": "min", "at": "last"}
    digits = SweepSpec.model_validate({"name": "d", "base": {**BASE, "task": "digits"}})
    assert resolve_objective(digits).as_dict()["metric"] == "eval_accuracy"
    assert resolve_objective(digits).mode == "max"


def test_overrides_create_sections_and_refuse_paths_through_values() -> None:
    spec = apply_overrides(BASE, {"training.lr": 0.5, "slurm.partition": "gpu"})
    assert spec["training"] == {"max_steps": 5, "lr": 0.5} and spec["slurm"] == {"partition": "gpu"}
    assert BASE["training"] == {"max_steps": 5}, "the input is not changed"
    with pytest.raises(OverridePathError, match="not an object"):
        apply_overrides(BASE, {"name.first": 1})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("training.lr=0.01", ("training.lr", 0.01)),
        ("training.lr=1e-3", ("training.lr", 0.001)),
        ("config.hidden=64", ("config.hidden", 64)),
        ("training.amp=false", ("training.amp", False)),
        ("training.optimizer=sgd", ("training.optimizer", "sgd")),
        ("tags=[a, b]", ("tags", ["a", "b"])),
    ],
)
def test_set_values_are_yaml_scalars(text: str, expected: tuple[str, Any]) -> None:
    assert parse_assignment(text) == expected


@pytest.mark.parametrize("text", ["training.lr", "=1", "training..lr=1", "a.b=[unclosed"])
def test_bad_set_says_how_to_write_it(text: str) -> None:
    with pytest.raises(OverridePathError):
        parse_assignment(text)


def test_a_range_too_wide_to_draw_from_is_refused_naming_the_axis() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="finite"):
        sweep(axes={"training.lr": {"uniform": [-1e308, 1e308]}}, samples=2)
    top = 1.7976931348623157e308
    spec = sweep(axes={"config.scale": {"loguniform": [top / 2, top]}}, samples=50)
    values = [o["config.scale"] for o in expand_overrides(spec)]
    assert all(top / 2 <= v <= top for v in values), "every draw is finite and in range"


def test_trial_keys_come_from_the_values_the_job_spec_holds(tmp_path: Any) -> None:
    settings = Settings(home=tmp_path)
    ints = plan_trials(sweep(axes={"config.hidden": {"grid": ["8", 16.0]}}), settings)
    assert [t.overrides["config.hidden"] for t in ints] == [8, 16]
    assert ints[0].key == trial_key({"config.hidden": 8, "training.seed": 0})
    with pytest.raises(SpecValidationError) as info:
        plan_trials(sweep(axes={"config.hidden": {"grid": [16, "16"]}}), settings)
    (error,) = info.value.errors
    assert error["loc"] == ["body", "axes", "config.hidden"] and '"16"' in error["msg"]
    assert error["type"] == "duplicate_trial"


def test_an_axis_no_spec_has_is_told_once_at_the_axis_not_per_trial(tmp_path: Any) -> None:
    settings = Settings(home=tmp_path)
    axes = {"training.lrr": {"grid": [0.1, 0.2, 0.3]}, "training.lr": {"grid": [0.1, -1.0]}}
    with pytest.raises(SpecValidationError) as info:
        plan_trials(sweep(axes=axes), settings)
    typo = [e for e in info.value.errors if e["loc"][1] == "axes"]
    assert [e["loc"] for e in typo] == [["body", "axes", "training.lrr"]], info.value.errors
    assert "did you mean" in typo[0]["msg"] and typo[0]["msg"].startswith("training.lrr: ")
    # A bad value is still each trial's own, at the trial.
    bad = [e["loc"] for e in info.value.errors if e["loc"][1] == "trials"]
    assert bad and all(loc[3] == "training.lr" for loc in bad), info.value.errors
