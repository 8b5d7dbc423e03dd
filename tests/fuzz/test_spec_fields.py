"""Every field of a fully written spec set to every odd value (extreme numbers, wrong types,
NUL, lone surrogates, huge text): ``validate_spec`` gives a storable spec or a
SpecValidationError naming fields, never another exception (each would be a 500).
Exhaustive and without HTTP; tests/fuzz/test_spec_properties.py samples the same over HTTP.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from service.core.config import Settings
from service.core.errors import SpecValidationError
from service.core.spec.model import JobSpec, validate_spec
from service.core.spec.task_configs import CharLMConfig, DigitsConfig, RegressionConfig

# Numbers at and past every bound a field could have (int32/int64, float range, NaN/inf).
EXTREME_NUMBER_VALUES: list[Any] = [
    *(0, -1, 1, 0.5, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**40, 1e308, -1e308, 5e-324),
    *(math.nan, math.inf, -math.inf, True),
]

# Every field written out (defaults included, so fields added later are covered too).
FULL_SPEC: dict[str, Any] = JobSpec.model_validate(
    {
        "name": "n",
        "task": "regression",
        "resources": {"nproc_per_node": 2, "mem_gb": 1.5},
        "backend": "gloo",
        "training": {"max_steps": 10, "checkpoint_every_steps": 5},
        "tags": ["t"],
    }
).model_dump(mode="json")
FULL_CONFIGS: dict[str, dict[str, Any]] = {
    **{
        task: schema.model_validate(example).model_dump(mode="json")
        for task, schema, example in (
            ("regression", RegressionConfig, {"fail_rank": 0, "fail_at_step": 1}),
            ("digits", DigitsConfig, {"model": "mlp"}),
            ("charlm", CharLMConfig, {}),
        )
    },
    "examples.fuzz:main": {"free": 1, "nested": {"x": [1.5, "y"]}},
}
FULL_SLURM: dict[str, Any] = {
    "partition": "p", "account": "a", "qos": "q", "constraint": "c", "time_limit_min": 5,
    "extra": {"exclusive": "1"},
}  # fmt: skip
ODD_VALUES: list[Any] = [
    *EXTREME_NUMBER_VALUES,
    None,
    "",
    "\x00",
    "\ud800",
    "x" * 10_000,
    [],
    {},
    [1],
    {"a": 1},
    "1",
    "1e400",
]


def _leaf_paths(value: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(value, dict) and value:
        return [p for k, v in value.items() for p in _leaf_paths(v, (*prefix, k))]
    return [prefix]


def _with(spec: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    changed = json.loads(json.dumps(spec))
    target = changed
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    return changed


def test_every_field_at_every_odd_value_is_a_spec_or_a_field_error() -> None:
    """Each field of a fully written spec (each built-in task's config too) set to each odd
    value: validate_spec returns a storable spec or raises SpecValidationError naming the
    field; no other exception (each would be a 500)."""
    deployment = Settings(allowed_entrypoints=["examples.*:*"], slurm_enabled=True)
    specs = {task: {**FULL_SPEC, "task": task, "config": c} for task, c in FULL_CONFIGS.items()}
    specs["slurm"] = {**FULL_SPEC, "launcher": "slurm", "slurm": FULL_SLURM}
    unexpected: list[str] = []
    for task, spec in specs.items():
        for path in _leaf_paths(spec):
            for value in ODD_VALUES:
                data = json.loads(json.dumps(_with(spec, path, value), allow_nan=True))
                try:
                    valid = validate_spec(data, deployment)
                except SpecValidationError as exc:
                    assert exc.errors and all(e["loc"][0] == "body" for e in exc.errors)
                    continue
                except Exception as exc:  # collected: every case is tried, all are reported
                    unexpected.append(f"{task} {'.'.join(path)}={value!r:.40}: {exc!r:.200}")
                    continue
                json.dumps(valid.model_dump(mode="json"), allow_nan=False)
    assert not unexpected, "validate_spec raised:\n" + "\n".join(unexpected)


def test_gpus_beyond_the_jobs_table_are_refused_whatever_the_cap() -> None:
    # jobs.gpus_per_node is a 32-bit INTEGER: a cap set above it must not let a value
    # through that PostgreSQL would refuse on insert (a 500).
    generous = Settings(max_gpus_per_node=2**40)
    spec = {"name": "n", "task": "regression", "resources": {"gpus_per_node": 2**31}}
    with pytest.raises(SpecValidationError) as refused:
        validate_spec(spec, generous)
    assert [e["loc"] for e in refused.value.errors] == [["body", "resources", "gpus_per_node"]]
    spec["resources"]["gpus_per_node"] = 2**31 - 1
    assert validate_spec(spec, generous).resources.gpus_per_node == 2**31 - 1
