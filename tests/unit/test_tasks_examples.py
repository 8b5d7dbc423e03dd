"""The example specs under examples/ validate as jobs, and the example entrypoint loads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from service.core.config import Settings
from service.core.spec.model import validate_spec
from worker.runtime.train.context import EntrypointError, load_entrypoint

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SETTINGS = Settings(allowed_entrypoints=["examples.*:*"])


@pytest.fixture(autouse=True)
def _in_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from the checkout, as a worker does; undo sys.path changes afterwards."""
    monkeypatch.chdir(EXAMPLES.parent)
    monkeypatch.setattr(sys, "path", list(sys.path))


@pytest.mark.parametrize("name", ["digits", "regression", "charlm", "custom_loop"])
def test_example_spec_validates(name: str) -> None:
    data = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    spec = validate_spec(data, SETTINGS)
    assert spec.resources.world_size == 2


def test_digits_example_is_tuned_as_promised() -> None:
    spec = validate_spec(yaml.safe_load((EXAMPLES / "digits.yaml").read_text()), SETTINGS)
    t = spec.training
    assert (t.epochs, t.batch_size, t.lr, t.optimizer) == (10, 32, 1e-3, "adamw")
    assert spec.resolved_backend == "gloo"


def test_example_entrypoint_loads_when_allowed() -> None:
    func = load_entrypoint("examples.custom_loop:train", SETTINGS)
    assert callable(func) and func.__name__ == "train"


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ("examples.custom_loop:train", "not allowed"),
        ("examples.nope:train", "cannot import"),
        ("examples.custom_loop:nope", "has no function"),
    ],
)
def test_entrypoint_refused(task: str, message: str) -> None:
    settings = Settings(allowed_entrypoints=[] if "not allowed" in message else ["examples.*:*"])
    with pytest.raises(EntrypointError, match=message):
        load_entrypoint(task, settings)


def test_custom_loop_says_how_to_allow_it_and_reports_like_the_builtins() -> None:
    import examples.custom_loop as custom_loop

    doc = custom_loop.__doc__ or ""
    assert """DDPQ_ALLOWED_ENTRYPOINTS='["examples.*:*"]' ddpq up""" in doc, doc
    source = (EXAMPLES / "custom_loop.py").read_text()
    assert "eval_accuracy" in source and "test_accuracy" not in source
