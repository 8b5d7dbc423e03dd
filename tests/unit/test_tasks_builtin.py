"""Built-in tasks: config → model and data shapes, the stdlib corpus, and the fault knobs."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch

from service.core.spec.task_configs import (
    BUILTIN_TASK_CONFIGS,
    CharLMConfig,
    DigitsConfig,
    RegressionConfig,
)
from worker.runtime.signals import StopFlag, StopRequested
from worker.tasks import TASKS, charlm, digits, regression
from worker.tasks.base import TaskSetup


def setup_for(config: dict[str, object], rank: int = 0) -> TaskSetup:
    return TaskSetup(config=config, seed=0, rank=rank, world_size=2, stop=StopFlag())


def test_every_builtin_config_has_a_task() -> None:
    assert set(TASKS) == set(BUILTIN_TASK_CONFIGS)


@pytest.mark.parametrize(
    ("config", "in_shape", "out_shape"),
    [
        ({}, (3, 10), (3, 5)),
        ({"in_features": 7, "hidden": 4, "out_features": 2}, (3, 7), (3, 2)),
    ],
)
def test_regression_shapes(
    config: dict[str, int], in_shape: tuple[int, int], out_shape: tuple[int, int]
) -> None:
    parts = TASKS["regression"](setup_for(config))
    assert parts.model(torch.zeros(in_shape)).shape == out_shape
    x, y = parts.train_set[0]
    assert x.shape == in_shape[1:] and y.shape == out_shape[1:]
    assert len(parts.train_set) == RegressionConfig.model_validate(config).num_samples  # type: ignore[arg-type]


def test_regression_data_is_a_function_of_the_seed() -> None:
    cfg = RegressionConfig(num_samples=16)
    a, b, c = (regression.make_dataset(cfg, seed) for seed in (1, 1, 2))
    assert torch.equal(a.tensors[0], b.tensors[0]) and torch.equal(a.tensors[1], b.tensors[1])
    assert not torch.equal(a.tensors[0], c.tensors[0])


@pytest.mark.parametrize("model", ["cnn", "mlp"])
def test_digits_shapes_and_split(model: str) -> None:
    parts = TASKS["digits"](setup_for({"model": model, "hidden": 16, "test_fraction": 0.25}))
    assert parts.model(torch.zeros(5, 64)).shape == (5, 10)
    assert parts.eval_set is not None and parts.classification
    n_train, n_test = len(parts.train_set), len(parts.eval_set)  # type: ignore[arg-type]
    assert n_train + n_test == 1797
    assert n_test == math.ceil(1797 * 0.25)
    x, y = parts.train_set[0]
    assert x.shape == (64,) and x.dtype == torch.float32 and y.dtype == torch.int64
    train_x = torch.stack([parts.train_set[i][0] for i in range(n_train)])
    assert train_x.mean().abs() < 0.05, "pixels are standardised with the train split's stats"


def test_digits_split_depends_on_the_seed() -> None:
    a, _ = digits.load_split(DigitsConfig(), 0)
    b, _ = digits.load_split(DigitsConfig(), 0)
    c, _ = digits.load_split(DigitsConfig(), 1)
    assert torch.equal(a.tensors[1], b.tensors[1])
    assert not torch.equal(a.tensors[1], c.tensors[1])


def test_charlm_shapes_and_shifted_targets() -> None:
    cfg = {"context": 16, "d_model": 32, "n_heads": 4, "n_layers": 1, "corpus_bytes": 10_000}
    parts = TASKS["charlm"](setup_for(cfg))
    assert parts.tokens_per_sample == 16
    x, y = parts.train_set[3]
    assert x.shape == y.shape == (16,) and x.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1]), "the target is the input shifted by one byte"
    logits = parts.model(torch.stack([x, y]))
    assert logits.shape == (2, 16, 256)
    loss = parts.loss_fn(logits, torch.stack([y, y]))
    assert loss.shape == () and math.isclose(loss.item(), math.log(256), rel_tol=0.25)


def test_charlm_is_causal() -> None:
    torch.manual_seed(0)
    model = charlm.CharTransformer(CharLMConfig(context=8, d_model=16, n_heads=2, n_layers=1))
    model.eval()
    x = torch.randint(0, 256, (1, 8))
    changed = x.clone()
    changed[0, 5] = (x[0, 5] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert torch.allclose(a[0, :5], b[0, :5], atol=1e-5), "a position must not see the future"
    assert not torch.allclose(a[0, 5:], b[0, 5:])


def test_charlm_rejects_heads_that_do_not_divide_d_model() -> None:
    with pytest.raises(ValueError, match="divisible"):
        charlm.CharTransformer(CharLMConfig(d_model=30, n_heads=4))


def test_corpus_is_the_sorted_stdlib_prefix(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "a.py").write_bytes(b"A" * 5)
    (tmp_path / "b" / "z.py").write_bytes(b"Z" * 5)
    (tmp_path / "b.py").write_bytes(b"B" * 5)  # "b.py" < "b/z.py" as path strings
    (tmp_path / "c.txt").write_bytes(b"no")
    (tmp_path / "site-packages" / "x.py").write_bytes(b"no")
    assert charlm.read_corpus(100, tmp_path) == b"AAAAABBBBBZZZZZ"
    assert charlm.read_corpus(7, tmp_path) == b"AAAAABB"
    real = charlm.read_corpus(20_000)
    assert len(real) == 20_000 and b"def " in real


def test_fault_fail_names_rank_and_step() -> None:
    faults = regression.FaultInjector(RegressionConfig(fail_rank=1, fail_at_step=5), 1, StopFlag())
    faults.before_step(4)
    with pytest.raises(RuntimeError, match=r"rank 1 at step 5"):
        faults.before_step(5)
    other_rank = regression.FaultInjector(
        RegressionConfig(fail_rank=1, fail_at_step=5), 0, StopFlag()
    )
    other_rank.before_step(5)


def test_fault_nan_poisons_the_value_not_the_gradient() -> None:
    faults = regression.FaultInjector(RegressionConfig(nan_at_step=3), 0, StopFlag())
    w = torch.ones(2, requires_grad=True)
    loss = faults.adjust_loss(3, (w * 2).sum())
    assert math.isnan(loss.item())
    loss.backward()
    assert w.grad is not None and torch.equal(w.grad, torch.tensor([2.0, 2.0]))
    assert faults.adjust_loss(4, torch.tensor(1.0)).item() == 1.0


def test_fault_hang_ends_when_a_stop_is_requested() -> None:
    stop = StopFlag()
    faults = regression.FaultInjector(RegressionConfig(hang_rank=0, hang_at_step=2), 0, stop)
    faults.before_step(1)
    timer = threading.Timer(0.3, stop.request, args=("test",))
    timer.start()
    with pytest.raises(StopRequested):
        faults.before_step(2)
    timer.join()
