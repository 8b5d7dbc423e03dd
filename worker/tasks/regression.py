"""Built-in task "regression": the seed tutorials' toy (Linear→ReLU→Linear, MSE) plus faults."""

from __future__ import annotations

import logging
import math
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

from service.core.spec.task_configs import RegressionConfig
from worker.runtime.signals import StopFlag, StopRequested
from worker.runtime.train.context import TrainContext
from worker.tasks.base import TaskParts, TaskSetup, run_task

log = logging.getLogger(__name__)
_HANG_POLL_S = 0.1


def build_model(cfg: RegressionConfig) -> nn.Sequential:
    """``Linear(in_features→hidden) → ReLU → Linear(hidden→out_features)``."""
    return nn.Sequential(
        nn.Linear(cfg.in_features, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, cfg.out_features)
    )


def make_dataset(cfg: RegressionConfig, seed: int) -> TensorDataset:
    """``num_samples`` random inputs (N, in_features) and targets (N, out_features) from
    ``seed``: a fixed random teacher plus noise, so the loss can actually fall."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(cfg.num_samples, cfg.in_features, generator=gen)
    teacher = torch.randn(cfg.in_features, cfg.out_features, generator=gen)
    noise = torch.randn(cfg.num_samples, cfg.out_features, generator=gen)
    y = torch.tanh(x @ teacher / math.sqrt(cfg.in_features)) + 0.1 * noise
    return TensorDataset(x, y)


class FaultInjector:
    """The config's fault knobs for one rank. A knob with only its step set applies to rank 0;
    one with only its rank set fires at step 1."""

    def __init__(self, cfg: RegressionConfig, rank: int, stop: StopFlag) -> None:
        self.cfg, self.rank, self.stop = cfg, rank, stop

    @staticmethod
    def _hits(rank: int, step: int, knob_rank: int | None, knob_step: int | None) -> bool:
        if knob_rank is None and knob_step is None:
            return False
        return rank == (knob_rank or 0) and step == (knob_step or 1)

    def before_step(self, step: int) -> None:
        """Sleep ``sleep_per_step_ms``; raise at ``fail_at_step``; hang at ``hang_at_step``
        (until a stop is requested: then ``StopRequested``)."""
        cfg = self.cfg
        if cfg.sleep_per_step_ms > 0:
            time.sleep(cfg.sleep_per_step_ms / 1000.0)
        if self._hits(self.rank, step, cfg.fail_rank, cfg.fail_at_step):
            raise RuntimeError(f"injected failure on rank {self.rank} at step {step}")
        if self._hits(self.rank, step, cfg.hang_rank, cfg.hang_at_step):
            log.warning("injected hang on rank %d at step %d", self.rank, step)
            while not self.stop.wait(_HANG_POLL_S):
                pass
            raise StopRequested(f"stopped while hanging at step {step}")

    def adjust_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """At ``nan_at_step`` the loss value becomes NaN on rank ``nan_rank`` (every rank when
        unset; a ``nan_rank`` alone fires at step 1). Its gradient stays the real one
        (``loss + (nan - loss.detach())``), so the model is not poisoned and later steps
        report finite losses again."""
        cfg = self.cfg
        if cfg.nan_rank is not None:
            nan_now = self._hits(self.rank, step, cfg.nan_rank, cfg.nan_at_step)
        else:
            nan_now = cfg.nan_at_step is not None and step == cfg.nan_at_step
        if nan_now:
            return loss + (torch.full_like(loss, math.nan) - loss.detach())
        return loss


def build(setup: TaskSetup) -> TaskParts:
    """The regression task for one rank."""
    cfg = RegressionConfig.model_validate(dict(setup.config))
    faults = FaultInjector(cfg, setup.rank, setup.stop)
    return TaskParts(
        model=build_model(cfg),
        train_set=make_dataset(cfg, setup.seed),
        loss_fn=nn.functional.mse_loss,
        before_step=faults.before_step,
        adjust_loss=faults.adjust_loss,
    )


def train(ctx: TrainContext) -> None:
    """Entrypoint: train the regression task over ``ctx`` (``task: "regression"``)."""
    run_task(build, ctx)
