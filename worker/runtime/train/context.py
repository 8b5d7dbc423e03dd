"""User entrypoints ("package.module:function"): loading them and the TrainContext they get."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, SupportsIndex

import torch
from torch import nn
from torch.utils.data import Dataset

from service.core.config import Settings
from service.core.metrics.points import checked_report
from service.core.spec.model import JobSpec
from service.core.wire.attempt import AttemptSelf, InitFrom
from worker.entrypoints import EntrypointError, import_failed, no_function
from worker.runtime.attempt_client import AttemptClient
from worker.runtime.checkpoints.fetch import StartPoint, agree_on_start
from worker.runtime.checkpoints.files import load_checkpoint_file
from worker.runtime.checkpoints.saver import CheckpointSaver
from worker.runtime.distributed import (
    DistContext,
    ResumableDistributedSampler,
    StopVote,
    all_reduce_sum_,
    make_sampler,
    wrap_model,
)
from worker.runtime.metrics.buffer import Sink
from worker.runtime.signals import StopFlag
from worker.runtime.timeline import AttemptFacts
from worker.runtime.train.nonfinite import REPORTED_LOSS, NonFinitePolicy, first_nonfinite
from worker.runtime.train.progress import ProgressClock
from worker.runtime.watchdog import NullWatchdog, StallWatchdog

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


class TrainContext:
    """What ``def train(ctx): ...`` receives: identity, device, config, and the job's services.
    Built-in tasks are entrypoints over it too (``worker.tasks``).

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

    def __init__(
        self,
        *,
        spec: JobSpec,
        dist: DistContext,
        sink: Sink,
        checkpointer: CheckpointSaver,
        stop: StopFlag,
        api: AttemptClient | None,
        artifact_dir: Path,
        job_id: int,
        attempt: int,
        watchdog: StallWatchdog | None = None,
        attempt_self: AttemptSelf | None = None,
    ) -> None:
        self.spec, self.config = spec, dict(spec.config)
        # GET /attempts/self at start (None: the API could not be asked): its init_from.
        self._attempt_self = attempt_self
        self._start: StartPoint | None = None
        self._start_agreed = False
        self.rank, self.local_rank, self.world_size = dist.rank, dist.local_rank, dist.world_size
        self.device, self.job_id, self.attempt = dist.device, job_id, attempt
        self.dist, self.sink, self.checkpointer, self.stop_flag = dist, sink, checkpointer, stop
        self.watchdog: StallWatchdog | NullWatchdog = (
            watchdog if watchdog is not None else NullWatchdog()
        )
        self.nonfinite = NonFinitePolicy(spec.training.nonfinite_loss, dist.rank)
        self.clock = ProgressClock()
        # The resume step, restore time, start and checkpoint stall rank 0 tells the API.
        self.facts = AttemptFacts(sink)
        self._api, self._artifact_dir = api, artifact_dir
        self._vote = StopVote(dist)
        self.last_step = 0
        self.last_epoch: int | None = None
        # For progress and ETA; set it when you know it (e.g. epochs × len(loader)).
        self.total_steps: int | None = spec.training.max_steps
        self.stopped = False
        self._known_names: set[str] = set()  # names ``report`` checked already
        self._check_losses = self.nonfinite.checks_reports
        self._warned_skip = False

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

        ``training.nonfinite_loss: fail`` applies to the metric ``loss`` on every rank: a
        float is checked at this call; a tensor when its batch is flushed (the flush copies
        it to the host anyway), so ``NonFiniteLossError`` is raised by the ``report`` call
        that flushes: the first report, then within ``FLUSH_EVERY_POINTS`` tensor reports or
        ``FLUSH_INTERVAL_S`` seconds (``worker.runtime.metrics.buffer``) of the bad step, or at
        the latest when the entrypoint returns. The points up to it are recorded first.

        Raises:
            ValueError: a step below 1 or past 2**53 - 1, an epoch outside 0..2**31 - 1, or a
                metric name over 100 characters (``service.core.metrics.points.checked_report``):
                raised here, in your loop, rather than the point being dropped at the write.
                Integer numpy scalars and 0-d tensors are fine as ``step`` and ``epoch``.
            NonFiniteLossError: a NaN/inf ``loss`` with ``training.nonfinite_loss: fail``
                (its ``reason`` is ``nonfinite_loss``).
        """
        step, epoch = checked_report(step, epoch, metrics, self._known_names)
        if not self.facts.began:  # before the first point: its resume step goes first
            self.facts.begin_at_report(step)
        sink = self.sink
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor):
                sink.report(step, epoch, value, name)
            else:
                sink.report_values(step, epoch, {name: value})
                if name == REPORTED_LOSS and self._check_losses:
                    self.nonfinite.check_reported(step, float(value))
        if step > self.last_step:
            self.last_step = step
        if epoch is not None:
            self.last_epoch = epoch
        if not self._check_losses and not self._warned_skip and REPORTED_LOSS in metrics:
            self._warn_skip_not_applied()
        self.watchdog.step_finished(self.last_step)  # a step finished (the first call starts it)
        if sink.flush_due() or sink.time_due():
            self.flush()

    def flush(self) -> None:
        """Hand buffered metrics to the writer now (rank 0; no collective).

        Raises:
            NonFiniteLossError: a buffered tensor ``loss`` was NaN/inf with
                ``training.nonfinite_loss: fail`` (after the batch was handed over).
        """
        bad = first_nonfinite(self.sink.buffered(REPORTED_LOSS)) if self._check_losses else None
        progress = self.clock.progress(self.last_step, self.total_steps, self.last_epoch)
        self.sink.flush(progress, average=False)
        if bad is not None:
            self.nonfinite.check_reported(*bad)

    def local_stop(self) -> bool:
        """This rank's own reason to stop, not yet agreed with its peers: a signal (cancel,
        preemption) or a fenced-off write (the attempt is stale)."""
        signalled = self.stop_flag.seen_at_step_boundary()  # called at every step boundary
        return signalled or self.sink.should_stop() or self.checkpointer.should_stop()

    @property
    def init_from(self) -> InitFrom | None:
        """The spec's ``init_from`` as the API resolved it (source job, step, ``mode``), when
        known; it applies only while the job has no checkpoint of its own."""
        return self._attempt_self.init_from if self._attempt_self is not None else None

    def agree_on_start(self) -> StartPoint | None:
        """Where this rank starts, the same on every rank: this job's newest intact checkpoint
        (``kind`` ``resume``), else its ``init_from`` checkpoint (``kind`` ``init``), fetched
        onto this host if need be; None on a fresh start. A collective, decided once (later
        calls return the same answer without one)."""
        if not self._start_agreed:
            with self.facts.restoring():
                self._start = agree_on_start(
                    self.dist, self._api, self._artifact_dir, self.job_id, self.attempt,
                    self._attempt_self,
                )  # fmt: skip
            self._start_agreed = True
            # The attempt's resume step (told to the API when training begins: ``facts``):
            # an init_from start resumes nothing of this job's own, so earlier attempts'
            # points are all superseded.
            start = self._start
            self.facts.resume_step = start.step if start is not None else 0
        return self._start

    def agree_on_resume(self) -> Path | None:
        """The newest intact checkpoint of this job (any attempt), the same on every rank;
        None on a fresh start or an ``init_from`` start. A collective."""
        start = self.agree_on_start()
        return start.path if start is not None and start.kind == "resume" else None

    def _warn_skip_not_applied(self) -> None:
        self._warned_skip = True
        log.warning(
            "training.nonfinite_loss=skip_step does not apply to a custom loop: ddpq does not "
            "run its optimizer step, so non-finite losses are recorded as they are (use 'fail' "
            "to stop the job on one, or skip the step in the loop)"
        )

    def save_checkpoint(self, state: dict[str, Any], step: int, epoch: int = 0) -> None:
        """Checkpoint ``state`` (e.g. model/optimizer state dicts) at ``step``: tensors are
        copied to CPU now, the file is written in the background (rank 0 only)."""
        with self.watchdog.pause(), self.facts.checkpoint_stall():  # a slow disk: no stall
            self.checkpointer.save(step, epoch, lambda: state)
        self.last_step = max(self.last_step, step)
        self.watchdog.step_finished(self.last_step)

    def load_checkpoint(self) -> dict[str, Any] | None:
        """The newest intact checkpoint of this job (any attempt), loaded onto ``device``;
        None on a fresh start. A collective: every rank loads the same one. Training counts
        as begun from here (the resume step is told to the API).

        A job without a checkpoint of its own but with ``init_from`` gets the source job's
        checkpoint: whole with mode ``full``; with ``weights_only`` only its ``"model"``
        entry (``{"model": ...}``: no optimizer, no step, so the loop starts at step 1)."""
        start = self.agree_on_start()
        if start is None:
            self.facts.begin(0)
            return None
        with self.facts.restoring():
            state = load_checkpoint_file(start.path, self.device)
        if start.kind == "init" and start.mode == "weights_only":
            state = {"model": state["model"]} if "model" in state else {}
        self.clock.restart(int(state.get("step", 0) or 0))
        self.facts.begin(self.facts.resume_step or 0)
        return state

    def should_stop(self) -> bool:
        """True when the job must stop (cancel, preemption, or this attempt was fenced off);
        every rank gets the same answer at the same call. Call once per step on every rank,
        then save a checkpoint and return."""
        self.watchdog.step_finished(self.last_step)
        if self._vote.poll(self.local_stop(), False).stop:
            self.stopped = True
        return self.stopped

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

    def close(self) -> None:
        """Flush what is buffered and settle the last stop vote (after the entrypoint returns).

        Raises:
            NonFiniteLossError: see ``flush``.
        """
        try:
            if self.sink.pending or self.last_step != self.clock.mark_step:
                self.flush()
        finally:
            self._vote.close()
