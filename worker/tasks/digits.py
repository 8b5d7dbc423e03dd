"""Built-in task "digits": a small CNN or MLP on scikit-learn's bundled 8×8 digits."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from service.core.spec.task_configs import DigitsConfig
from worker.runtime.train.context import TrainContext
from worker.tasks.base import TaskParts, TaskSetup, run_task

NUM_CLASSES = 10
IMAGE_SIDE = 8
PIXEL_MAX = 16.0  # load_digits pixels are integers 0..16
# Added to each pixel's std before standardising, so near-constant border pixels stay quiet.
STD_FLOOR = 0.1


class DigitsCNN(nn.Module):
    """Input (B, 64) pixels → logits (B, 10): two 3×3 convs, one 2×2 pool, an MLP head."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(32 * (IMAGE_SIDE // 2) ** 2, hidden),
            nn.ReLU(),
            nn.Linear(hidden, NUM_CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.view(-1, 1, IMAGE_SIDE, IMAGE_SIDE)))


def build_model(cfg: DigitsConfig) -> nn.Module:
    """The configured model: ``cnn`` (default) or ``mlp`` (64→hidden→hidden→10)."""
    if cfg.model == "mlp":
        return nn.Sequential(
            nn.Linear(IMAGE_SIDE**2, cfg.hidden),
            nn.ReLU(),
            nn.Linear(cfg.hidden, cfg.hidden),
            nn.ReLU(),
            nn.Linear(cfg.hidden, NUM_CLASSES),
        )
    return DigitsCNN(cfg.hidden)


def load_split(cfg: DigitsConfig, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Train and test sets: (N, 64) float pixels and (N,) int64 labels, split stratified by
    ``test_fraction`` with ``seed`` (scikit-learn ships the data; no download). Pixels are
    standardised per position with the train split's mean and std (+ ``STD_FLOOR``)."""
    from sklearn.datasets import load_digits  # import here: only this task needs sklearn
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        data.data,
        data.target,
        test_size=cfg.test_fraction,
        random_state=seed,
        stratify=data.target,
    )

    train_pixels = torch.as_tensor(x_train, dtype=torch.float32) / PIXEL_MAX
    mean, scale = train_pixels.mean(dim=0), train_pixels.std(dim=0) + STD_FLOOR

    def to_set(x: object, y: object) -> TensorDataset:
        images = (torch.as_tensor(x, dtype=torch.float32) / PIXEL_MAX - mean) / scale
        return TensorDataset(images, torch.as_tensor(y, dtype=torch.int64))

    return to_set(x_train, y_train), to_set(x_test, y_test)


def build(setup: TaskSetup) -> TaskParts:
    """The digits task for one rank: reports loss per step, eval_loss/eval_accuracy per epoch."""
    cfg = DigitsConfig.model_validate(dict(setup.config))
    train_set, test_set = load_split(cfg, setup.seed)
    return TaskParts(
        model=build_model(cfg),
        train_set=train_set,
        eval_set=test_set,
        loss_fn=nn.functional.cross_entropy,
        classification=True,
    )


def train(ctx: TrainContext) -> None:
    """Entrypoint: train the digits task over ``ctx`` (``task: "digits"``)."""
    run_task(build, ctx)
