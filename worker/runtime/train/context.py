"""User entrypoints ("package.module:function"): loading them and the TrainContext they get."""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, SupportsIndex

import torch
from torch import nn
from torch.utils.data import Dataset

from service.core.config import Settings
from worker.entrypoints import EntrypointError, import_failed, no_function
from worker.runtime.distributed import (
    ResumableDistributedSampler,
    all_reduce_sum_,
    make_sampler,
    wrap_model,
)
from worker.runtime.train.session import RankSession

log = logging.getLogger(__name__)
Entrypoint = Callable[["TrainContext"], Any]


def load_entrypoint(task: str, settings: Settings) -> Entrypoint:
    """Import ``"package.module:function"`` after re-checking the deployment's allow-list.

    Modules are looked up on ``sys.path`` plus the working directory (appended, as
    ``python -m`` does), so an entrypoint can live in the worker's checkout.

    Raises:
        EntrypointError: not on ``settings.allowed_entrypoints``, not importable, or not
            callable.
    """
    if not settings.entrypoint_allowed(task):
        allowed = ", ".join(settings.allowed_entrypoints) or "none configured"
        raise EntrypointError(
            f"entrypoint {task!r} is not allowed on this worker "
            f"(DDPQ_ALLOWED_ENTRYPOINTS: {allowed})"
        )
    module_name, _, func_name = task.partition(":")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # as ``python -m`` would: the job's working directory, last
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise import_failed(task, exc, cwd) from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise no_function(task)
    return func


class TrainContext(RankSession):
    """What ``def train(ctx): ...`` receives: identity, device, config, and the job's services.
    Built-in tasks are entrypoints over it too (``worker.tasks``); its metrics, checkpoints
    and stop vote are the rank's ``RankSession`` (``worker.runtime.train.session``), the same one
    the ``ddpq`` library's calls reach in this rank.

    Attributes:
        rank, local_rank, world_size: this rank's place in the job.
        device: ``cuda:<local_rank>`` when the job has GPUs, else CPU.
        config: the job's ``config`` object (a dict).
        spec: the whole JobSpec (``spec.training`` holds epochs, batch_size, lr, seed, ...).
        dist, sink, checkpointer, stop_flag, watchdog, nonfinite, clock: the rank's services,
            for the built-in trainer (``worker.runtime.train.trainer``); your loop needs only the
            methods below.

    Rank-0 discipline is built in: call ``report`` and ``save_checkpoint`` on every rank (or
    on rank 0 alone); only rank 0's calls are recorded. ``should_stop`` and
    ``load_checkpoint`` are collectives: call them on every rank at the same point.

    Stall detection (``training.stall_timeout_s``): ``report``, ``should_stop`` and
    ``save_checkpoint`` tell the rank's watchdog that a step finished; the first such call
    starts its clock. A rank that calls none of them for ``stall_timeout_s`` seconds is
    stalled: call one of them every step on every rank (``should_stop`` is meant to be).

    ``training.nonfinite_loss`` applies to what you report as ``loss`` (see ``report``):
    with ``fail`` (the default) a NaN/inf ``loss`` fails the job with reason
    ``nonfinite_loss``, as in a built-in task. With ``skip_step`` nothing is skipped (ddpq
    does not run your optimizer step) and the values are recorded as they are: skip the step
    in your loop if you want that (a warning says so at the first ``loss`` reported).
    """

    @functools.cached_property
    def config(self) -> dict[str, Any]:
        """The job's ``config`` object (a dict)."""
        return dict(self.spec.config)

    def report(
        self,
        step: SupportsIndex,
        epoch: SupportsIndex | None = None,
        **metrics: float | torch.Tensor,
    ) -> None:
        """Record metrics at global ``step`` (1-based): ``ctx.report(step, loss=loss)``.
        Only rank 0's values are kept: average over ranks first with ``all_reduce_mean`` if
        you want the global mean. See ``RankSession.report_metrics`` for the checks and errors."""
        self.report_metrics(step, epoch, metrics)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to ``device`` and wrap it for the job's strategy (DDP or DataParallel).
        Build the optimizer on the returned module; save ``.module.state_dict()``."""
        return wrap_model(model, self.dist)

    def distributed_sampler(
        self, dataset: Dataset[Any], *, shuffle: bool = True
    ) -> ResumableDistributedSampler[Any]:
        """This rank's shard of ``dataset``, seeded with ``spec.training.seed``; call
        ``set_epoch(epoch)`` every epoch."""
        return make_sampler(dataset, self.dist, seed=self.spec.training.seed, shuffle=shuffle)

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mean of ``tensor`` over ranks (a new tensor; a collective)."""
        out = tensor.detach().clone()
        all_reduce_sum_(out, self.dist)
        return out / self.world_size
