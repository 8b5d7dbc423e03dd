"""User entrypoints ("package.module:function"): loading them and the TrainContext they get."""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, SupportsIndex

import torch
from torch import nn
from torch.utils.data import Dataset

from service.core.config import Settings
from service.core.errors import DdpqError
from service.core.metric_points import checked_report
from service.core.spec import JobSpec
from worker.runtime.checkpointing import NullCheckpointer, agree_on_resume, load_checkpoint_file
from worker.runtime.distributed import (
    DistContext,
    ResumableDistributedSampler,
    StopVote,
    all_reduce_sum_,
    make_sampler,
    wrap_model,
)
from worker.runtime.signals import StopFlag
from worker.runtime.sink_buffer import MetricsSink, Progress
from worker.runtime.watchdog import NullWatchdog, StallWatchdog

Entrypoint = Callable[["TrainContext"], Any]


class EntrypointError(DdpqError):
    """A user entrypoint is not allowed here, or cannot be imported."""

    code = "entrypoint"


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
        raise EntrypointError(
            f"cannot import {module_name!r} for entrypoint {task!r}: {exc}; the worker's "
            f"ranks must be able to import it: install it in the worker's venv or put its "
            f"directory on the worker's PYTHONPATH (working directory {cwd})"
        ) from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise EntrypointError(f"{module_name!r} has no function {func_name!r}")
    return func


class TrainContext:
    """What ``def train(ctx): ...`` receives: identity, device, config, and the job's services.

    Attributes:
        rank, local_rank, world_size: this rank's place in the job.
        device: ``cuda:<local_rank>`` when the job has GPUs, else CPU.
        config: the job's ``config`` object (a dict).
        spec: the whole JobSpec (``spec.training`` holds epochs, batch_size, lr, seed, ...).

    Rank-0 discipline is built in: call ``report`` and ``save_checkpoint`` on every rank (or
    on rank 0 alone); only rank 0's calls are recorded. ``should_stop`` and
    ``load_checkpoint`` are collectives: call them on every rank at the same point.

    Stall detection (``training.stall_timeout_s``): ``report``, ``should_stop`` and
    ``save_checkpoint`` tell the rank's watchdog that a step finished; the first such call
    starts its clock. A rank that calls none of them for ``stall_timeout_s`` seconds is
    stalled: call one of them every step on every rank (``should_stop`` is meant to be).
    ``training.nonfinite_loss`` is not applied to your loop: ddpq does not run your steps.
    """

    def __init__(
        self,
        *,
        spec: JobSpec,
        dist: DistContext,
        sink: MetricsSink,
        checkpointer: NullCheckpointer,
        stop: StopFlag,
        db: Any,
        artifact_dir: Path,
        job_id: int,
        attempt: int,
        watchdog: StallWatchdog | None = None,
    ) -> None:
        self.spec, self.config = spec, dict(spec.config)
        self.rank, self.local_rank, self.world_size = dist.rank, dist.local_rank, dist.world_size
        self.device, self.job_id, self.attempt = dist.device, job_id, attempt
        self._dist, self._sink, self._checkpointer, self._stop = dist, sink, checkpointer, stop
        self._db, self._artifact_dir = db, artifact_dir
        self._vote = StopVote(dist)
        self.last_step = 0
        self.last_epoch: int | None = None
        # For progress and ETA; set it when you know it (e.g. epochs × len(loader)).
        self.total_steps: int | None = spec.training.max_steps
        self.stopped = False
        self._started = (time.monotonic(), 0)
        self._watchdog = watchdog if watchdog is not None else NullWatchdog()

    def report(
        self,
        step: SupportsIndex,
        epoch: SupportsIndex | None = None,
        **metrics: float | torch.Tensor,
    ) -> None:
        """Record metrics at global ``step`` (1-based): ``ctx.report(step, loss=loss)``.

        Tensors stay on their device until a batch is flushed (no host sync per call); floats
        are taken as they are. Only rank 0's values are kept: average over ranks first with
        ``all_reduce_mean`` if you want the global mean. Duplicate (name, step) are ignored.

        Raises:
            ValueError: a step below 1 or past 2**53 - 1, an epoch outside 0..2**31 - 1, or a
                metric name over 100 characters (``service.core.metric_points.checked_report``):
                raised here, in your loop, rather than the point being dropped at the write.
                Integer numpy scalars and 0-d tensors are fine as ``step`` and ``epoch``.
        """
        # Checked once, here: the sink and its writer trust these keys (checked=True).
        step, epoch = checked_report(step, epoch, metrics)  # numpy/tensor ints as ints
        sink = self._sink
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor):
                sink.report(step, epoch, value, name, checked=True)
            else:
                sink.report_values(step, epoch, {name: value}, checked=True)
        if step > self.last_step:
            self.last_step = step
        if epoch is not None:
            self.last_epoch = epoch
        self._watchdog.step_finished(self.last_step)  # a step finished (the first call starts it)
        if sink.flush_due() or sink.time_due():
            self.flush()

    def flush(self) -> None:
        """Hand buffered metrics to the writer now (rank 0; no collective)."""
        total = self.total_steps
        start_s, start_step = self._started
        done = self.last_step - start_step
        eta_s = None
        if total is not None and done > 0:
            eta_s = (time.monotonic() - start_s) / done * max(total - self.last_step, 0)
        progress = Progress(self.last_step, total, self.last_epoch, None, eta_s)
        self._sink.flush(progress, average=False)

    def save_checkpoint(self, state: dict[str, Any], step: int, epoch: int = 0) -> None:
        """Checkpoint ``state`` (e.g. model/optimizer state dicts) at ``step``: tensors are
        copied to CPU now, the file is written in the background (rank 0 only)."""
        with self._watchdog.pause():  # a slow disk is not a stall
            self._checkpointer.save(step, epoch, lambda: state)
        self.last_step = max(self.last_step, step)
        self._watchdog.step_finished(self.last_step)

    def load_checkpoint(self) -> dict[str, Any] | None:
        """The newest intact checkpoint of this job (any attempt), loaded onto ``device``;
        None on a fresh start. A collective: every rank loads the same one."""
        path = agree_on_resume(self._dist, self._db, self._artifact_dir, self.job_id)
        if path is None:
            return None
        state = load_checkpoint_file(path, self.device)
        self._started = (time.monotonic(), int(state.get("step", 0) or 0))
        return state

    def should_stop(self) -> bool:
        """True when the job must stop (cancel, preemption, or this attempt was fenced off);
        every rank gets the same answer at the same call. Call once per step on every rank,
        then save a checkpoint and return."""
        self._watchdog.step_finished(self.last_step)
        local = self._stop.is_set() or self._sink.should_stop() or self._checkpointer.should_stop()
        if self._vote.poll(local, False).stop:
            self.stopped = True
        return self.stopped

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to ``device`` and wrap it for the job's strategy (DDP or DataParallel).
        Build the optimizer on the returned module; save ``.module.state_dict()``."""
        return wrap_model(model, self._dist)

    def distributed_sampler(
        self, dataset: Dataset[Any], *, shuffle: bool = True
    ) -> ResumableDistributedSampler[Any]:
        """This rank's shard of ``dataset``, seeded with ``spec.training.seed``; call
        ``set_epoch(epoch)`` every epoch."""
        return make_sampler(dataset, self._dist, seed=self.spec.training.seed, shuffle=shuffle)

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mean of ``tensor`` over ranks (a new tensor; a collective)."""
        out = tensor.detach().clone()
        all_reduce_sum_(out, self._dist)
        return out / self.world_size

    def close(self) -> None:
        """Flush what is buffered and settle the last stop vote (after the entrypoint returns)."""
        self.flush()
        self._vote.close()
