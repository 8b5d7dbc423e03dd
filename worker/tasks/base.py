"""What a built-in task hands the trainer (TaskParts), what it is built from (TaskSetup), and
``run_task``: a built-in task as an entrypoint over ``TrainContext``, like users' code."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from worker.runtime.signals import StopFlag
from worker.runtime.train.context import TrainContext
from worker.runtime.train.trainer import Trainer, TrainResult

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TaskSetup:
    """Inputs of a task builder: its validated ``config`` and who is building it.

    ``stop`` is the rank's local stop flag: code that blocks on purpose (an injected hang)
    must poll it and raise ``StopRequested`` so a SIGTERM still ends the rank.
    """

    config: Mapping[str, Any]
    seed: int
    rank: int
    world_size: int
    stop: StopFlag


@dataclass
class TaskParts:
    """A built-in task: a bare model (on CPU) and its data; the trainer does the rest.

    ``train_set``/``eval_set`` yield ``(input, target)`` pairs. ``loss_fn(output, target)``
    returns the mean loss of a batch (a 0-d tensor). With ``classification`` the evaluation
    also reports ``eval_accuracy`` (argmax over the last dim of the output). With
    ``tokens_per_sample`` the trainer reports ``tokens_per_s``. ``before_step(step)`` and
    ``adjust_loss(step, loss)`` are fault-injection hooks (regression's knobs).
    """

    model: nn.Module
    train_set: Dataset[Any]
    loss_fn: LossFn
    eval_set: Dataset[Any] | None = None
    classification: bool = False
    tokens_per_sample: int | None = None
    before_step: Callable[[int], None] | None = None
    adjust_loss: Callable[[int, torch.Tensor], torch.Tensor] | None = None


TaskBuilder = Callable[[TaskSetup], TaskParts]


def run_task(build: TaskBuilder, ctx: TrainContext) -> TrainResult:
    """Train the task ``build`` makes over ``ctx``: agree on the checkpoint to resume from,
    build the task for this rank, run the built-in ``Trainer``. A collective (every rank)."""
    start = ctx.agree_on_start()
    setup = TaskSetup(ctx.config, ctx.spec.training.seed, ctx.rank, ctx.world_size, ctx.stop_flag)
    return Trainer(build(setup), ctx, start).run()
