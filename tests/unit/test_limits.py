"""Each number in ``service.core.limits`` is the one the modules that share it enforce, and
says its unit."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.core import limits
from service.core.config import Settings
from service.core.metrics.points import _check_name
from service.core.spec.model import JobSpec
from service.core.sweeps.spec import SweepSpec
from service.core.wire import attempt as wire

UNITS = ("_CHARS", "_BYTES", "_ITEMS", "_POINTS", "_S")


def test_every_limit_says_its_unit_and_why() -> None:
    source = inspect.getsource(limits)
    lines = source.splitlines()
    for node in ast.parse(source).body:
        if not isinstance(node, ast.Assign):
            continue
        (target,) = node.targets
        assert isinstance(target, ast.Name)
        name = target.id
        comment = lines[node.lineno - 2].strip()
        assert comment.startswith("#"), f"{name}: a comment above says what it bounds"
        assert name.endswith(UNITS) or "(" in comment, f"{name}: its unit in the name or comment"


def test_a_job_name_fits_exactly_its_cap() -> None:
    JobSpec(name="n" * limits.MAX_JOB_NAME_CHARS, task="regression")
    with pytest.raises(ValidationError):
        JobSpec(name="n" * (limits.MAX_JOB_NAME_CHARS + 1), task="regression")


def test_a_metric_name_fits_exactly_its_cap() -> None:
    name = "m" * limits.MAX_METRIC_NAME_CHARS
    _check_name(name)
    with pytest.raises(ValueError, match=f"1-{limits.MAX_METRIC_NAME_CHARS} characters"):
        _check_name(name + "m")


def test_settings_and_wire_share_the_numbers(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    assert settings.max_list_limit == limits.MAX_PAGE_ITEMS
    assert settings.checkpoint_chunk_bytes == wire.DEFAULT_CHUNK_BYTES
    path_field = wire.CheckpointRecord.model_fields["path"]
    assert any(getattr(m, "max_length", None) == limits.MAX_PATH_BYTES for m in path_field.metadata)
    seeds = SweepSpec.model_fields["seeds"]
    assert any(getattr(m, "le", None) == limits.MAX_SEEDS for m in seeds.metadata)
