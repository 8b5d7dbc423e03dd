"""Built-in task configs that cannot train are refused before queueing, through
``validate_spec``, with a message that names the field and the fix."""

from __future__ import annotations

from typing import Any

import pytest

from service.core.config import Settings
from service.core.errors import SpecValidationError
from service.core.spec.model import validate_spec
from service.core.spec.task_configs import RegressionConfig

SETTINGS = Settings()


def _errors(task: str, config: dict[str, Any]) -> list[dict[str, Any]]:
    with pytest.raises(SpecValidationError) as info:
        validate_spec({"name": "t", "task": task, "config": config}, SETTINGS)
    return info.value.errors


@pytest.mark.parametrize(
    ("task", "config", "loc", "needles"),
    [
        (
            "charlm",
            {"d_model": 10, "n_heads": 3},
            ["body", "config"],
            ["d_model=10 must be divisible by n_heads=3", "n_heads to one of 1, 2, 5, 10", "12"],
        ),
        (
            "charlm",
            {"d_model": 64, "n_heads": 48},
            ["body", "config"],
            ["d_model=64 must be divisible by n_heads=48", "1, 2, 4, 8, 16, 32, 64"],
        ),
        (
            "digits",
            {"test_fraction": 0.9999},
            ["body", "config", "test_fraction"],
            ["test_fraction=0.9999", "between 0.05 and 0.5", "at least one batch"],
        ),
        (
            "digits",
            {"test_fraction": 0.01},
            ["body", "config", "test_fraction"],
            ["test_fraction=0.01 would hold out 18 of the 1,797 images", "between 0.05 and 0.5"],
        ),
        (
            "digits",
            {"test_fraction": 0.51},
            ["body", "config", "test_fraction"],
            ["between 0.05 and 0.5"],
        ),
    ],
)
def test_config_that_cannot_train_is_refused(
    task: str, config: dict[str, Any], loc: list[str], needles: list[str]
) -> None:
    errors = _errors(task, config)
    assert [e["loc"] for e in errors] == [loc], errors
    for needle in needles:
        assert needle in errors[0]["msg"], f"{needle!r} not in {errors[0]['msg']!r}"


@pytest.mark.parametrize(
    ("task", "config"),
    [
        ("charlm", {"d_model": 12, "n_heads": 3}),
        ("charlm", {}),
        ("digits", {"test_fraction": 0.05}),
        ("digits", {"test_fraction": 0.5}),
        ("digits", {}),
        ("regression", {"fail_rank": 1, "fail_at_step": 3, "hang_rank": 0, "hang_at_step": 2}),
    ],
)
def test_workable_config_is_accepted(task: str, config: dict[str, Any]) -> None:
    data = {"name": "t", "task": task, "config": config, "resources": {"nproc_per_node": 2}}
    spec = validate_spec(data, SETTINGS)
    assert spec.config.items() >= config.items()


def test_a_regression_dataset_too_big_for_memory_is_refused_at_submit() -> None:
    with pytest.raises(ValueError, match="lower num_samples or in_features"):
        RegressionConfig(num_samples=10_000_000, in_features=100_000)
    RegressionConfig(num_samples=1_000_000, in_features=100)  # 0.4 GiB: fine
