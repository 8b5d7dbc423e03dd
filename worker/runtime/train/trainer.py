"""The training loop of the built-in tasks: steps, epochs, eval, cadence of flushes and
checkpoints, resume, and stopping together.

A built-in task is an entrypoint over ``TrainContext`` like users' code
(``Trainer(parts, ctx).run()``, see ``worker.tasks.base.run_task``): the sink, the
checkpointer, the stop flag, the watchdog, the non-finite loss policy and the progress clock
are the context's, so each is written once for both kinds of loop.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

from service.core.spec.model import Training
from worker.runtime.checkpoints.fetch import StartPoint
from worker.runtime.checkpoints.files import load_checkpoint_file
from worker.runtime.distributed import (
    all_reduce_sum_,
    make_sampler,
    unwrap_model,
    wrap_model,
)
from worker.runtime.train.context import TrainContext
from worker.runtime.train.nonfinite import poison_gradients

if TYPE_CHECKING:  # worker.tasks.base runs this trainer
    from worker.tasks.base import TaskParts

log = logging.getLogger(__name__)
CHECKPOINT_FORMAT = 1
EVAL_BATCH_SIZE = 256
# How long the end of training waits for the metrics writer before its checkpoint (seconds):
# a healthy API needs milliseconds; this leaves the checkpoint half of the launcher's
# SIGTERM → SIGKILL grace (10 s).
STOP_DRAIN_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class TrainResult:
    """How the loop ended: the last global step, and whether it stopped early."""

    step: int
    stopped: bool


def build_optimizer(training: Training, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The spec's optimizer over ``params`` (pass the WRAPPED model's parameters)."""
    if training.optimizer == "sgd":
        return torch.optim.SGD(params, lr=training.lr, momentum=0.9)
    if training.optimizer == "adam":
        return torch.optim.Adam(params, lr=training.lr)
    return torch.optim.AdamW(params, lr=training.lr)


def plan_total_steps(training: Training, steps_per_epoch: int) -> int:
    """Global steps of the whole run: ``epochs × steps_per_epoch``, capped by ``max_steps``."""
    total = training.epochs * steps_per_epoch
    return min(total, training.max_steps) if training.max_steps is not None else total


def rng_state() -> dict[str, Any]:
    """This process's torch/numpy/python (and CUDA) RNG states."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of ``rng_state`` (tensors may come back on a GPU after map_location)."""
    torch.set_rng_state(state["torch"].cpu())
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


class Trainer:
    """Runs one task on one rank; every rank runs the same sequence of collectives.

    Rank-0-only work is inside ``ctx.sink`` and ``ctx.checkpointer`` (see ``make_sink`` and
    ``make_checkpointer``); the loop itself never asks which rank it is. ``run`` leaves
    ``ctx.last_step``, ``ctx.last_epoch`` and ``ctx.stopped`` as a custom loop's calls would.

    Args:
        parts: the task's model and data.
        ctx: the rank's context (its services and the spec).
        start: where to start (``ctx.agree_on_start()``): this job's checkpoint to resume
            from, another job's (``init_from``), or None for a fresh start.
    """

    def __init__(
        self, parts: TaskParts, ctx: TrainContext, start: StartPoint | None = None
    ) -> None:
        dist = ctx.dist
        self.parts, self.spec, self.ctx, self.dist = parts, ctx.spec, ctx, dist
        self.sink, self.checkpointer, self.stop = ctx.sink, ctx.checkpointer, ctx.stop_flag
        self.start = start
        t = self.spec.training
        # Stall detection (started with the first step, petted per step) and the NaN policy.
        self.watchdog, self.nonfinite = ctx.watchdog, ctx.nonfinite
        self.model = wrap_model(parts.model, dist)
        self.bare = unwrap_model(self.model)
        self.optimizer = build_optimizer(t, self.model.parameters())
        self.sampler = make_sampler(parts.train_set, dist, seed=t.seed)
        self.loader = DataLoader(
            parts.train_set, batch_size=t.batch_size, sampler=self.sampler, pin_memory=dist.on_gpu
        )
        self.steps_per_epoch = max(1, math.ceil(self.sampler.num_samples / t.batch_size))
        self.total_steps = plan_total_steps(t, self.steps_per_epoch)
        ctx.total_steps = self.total_steps
        self.amp = dist.on_gpu and t.amp
        self.epoch = self.step = self.batch_idx = 0
        self.clock = ctx.clock
        self.clock.restart(0)

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        """Train until ``total_steps``, the last epoch, or a collective stop decision."""
        t = self.spec.training
        resumed_step = self._resume(self.start) if self.start is not None else None
        self.ctx.facts.begin(resumed_step or 0)  # before the first point (see timeline.py)
        vote = self.ctx.vote  # the rank's one stop vote (its session's)
        stopped = False
        evaluated_at: int | None = None
        self.model.train()
        self.watchdog.start(self.step)
        while self.epoch < t.epochs and self.step < self.total_steps and not stopped:
            self.sampler.set_epoch(self.epoch)
            self.sampler.start_index = self.batch_idx * t.batch_size
            for inputs, targets in self.loader:
                self.step += 1
                self.batch_idx += 1
                loss = self._train_step(inputs, targets)
                self.watchdog.pet(self.step)
                if self.step % t.log_every_steps == 0:
                    self.sink.report(self.step, self.epoch, loss)
                if t.checkpoint_every_steps and self.step % t.checkpoint_every_steps == 0:
                    self._flush()  # hand its points over first: it waits for them
                    self._checkpoint()
                decision = vote.collect()  # voted one step ago: the same on every rank
                if decision.flush or self.sink.flush_due():
                    self._flush()
                vote.launch(self.ctx.local_stop(), self.sink.time_due())
                if decision.stop:
                    stopped = True
                    break
                if self.step >= self.total_steps:
                    break
            self.sampler.start_index = 0
            if stopped or self.batch_idx < self.steps_per_epoch:
                continue
            self._evaluate()
            evaluated_at = self.step
            self._flush()
            every = t.checkpoint_every_epochs
            if (every is None and t.checkpoint_every_steps is None) or (
                every is not None and (self.epoch + 1) % every == 0
            ):
                self._checkpoint()
            self.epoch += 1
            self.batch_idx = 0
        vote.close()
        stale = self.sink.should_stop() or self.checkpointer.should_stop()
        if not stopped and evaluated_at != self.step:
            self._evaluate()
        self._flush()
        if not stale and 0 < self.step != resumed_step and (not stopped or self.stop.is_set()):
            # The next attempt resumes after this checkpoint's step, so the points it covers
            # must be stored first: a process killed with them still queued loses them.
            if not self.sink.drain(STOP_DRAIN_TIMEOUT_S):
                log.warning("metrics not all written after %.0f s; checkpointing anyway",
                            STOP_DRAIN_TIMEOUT_S)  # fmt: skip
            # The end of training, or a signal (preemption, cancel): after the last step, so
            # its wait is the attempt's teardown, not a stall of training.
            self._checkpoint(stall=False)
        ctx = self.ctx
        ctx.last_step, ctx.stopped = self.step, stopped
        ctx.last_epoch = min(self.epoch, t.epochs - 1)
        return TrainResult(step=self.step, stopped=stopped)

    def _train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.parts.before_step is not None:
            self.parts.before_step(self.step)
        device = self.dist.device
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=self.amp):
            loss = self.parts.loss_fn(self.model(inputs), targets)
        if self.parts.adjust_loss is not None:
            loss = self.parts.adjust_loss(self.step, loss)
        self.optimizer.zero_grad(set_to_none=True)
        poison_gradients(loss).backward()  # a non-finite loss on any rank → NaN grads on all
        if self.nonfinite.allows_step(self.step, loss, self.model.parameters()):
            self.optimizer.step()
        else:
            skipped = float(self.nonfinite.skipped)
            self.sink.report_values(self.step, self.epoch, {"skipped_steps": skipped}, reduced=True)
        return loss

    # -- reporting -----------------------------------------------------------------------------
    def _flush(self) -> None:
        """Collective: every rank flushes at the same step with the same buffered keys."""
        advanced = self.step > self.clock.mark_step
        progress = self.clock.progress(
            self.step,
            self.total_steps,
            min(self.epoch, self.spec.training.epochs - 1),
            samples_per_step=self.spec.training.batch_size * self.dist.world_size,
        )
        if advanced and self.parts.tokens_per_sample and progress.samples_per_s is not None:
            tokens_per_s = progress.samples_per_s * self.parts.tokens_per_sample
            values = {"tokens_per_s": tokens_per_s}  # of all ranks
            self.sink.report_values(self.step, self.epoch, values, reduced=True)
        self.sink.flush(progress)

    def _evaluate(self) -> None:
        """Sharded evaluation + one all_reduce: ``eval_loss`` (and ``eval_accuracy``)."""
        eval_set = self.parts.eval_set
        if eval_set is None:
            return
        shard = Subset(eval_set, range(self.dist.rank, len(eval_set), self.dist.world_size))  # type: ignore[arg-type]
        sums = torch.zeros(3, device=self.dist.device, dtype=torch.float64)
        self.bare.eval()
        with (
            torch.no_grad(),
            torch.autocast(self.dist.device.type, dtype=torch.bfloat16, enabled=self.amp),
        ):
            for inputs, targets in DataLoader(shard, batch_size=EVAL_BATCH_SIZE):
                inputs, targets = inputs.to(self.dist.device), targets.to(self.dist.device)
                output = self.bare(inputs)
                n = targets.shape[0]
                sums[0] += self.parts.loss_fn(output, targets).double() * n
                if self.parts.classification:
                    sums[1] += (output.argmax(dim=-1) == targets).sum()
                sums[2] += n
                self.watchdog.pet()  # a long evaluation is progress, not a stall
        self.bare.train()
        loss_sum, correct, count = all_reduce_sum_(sums, self.dist).tolist()
        values = {"eval_loss": loss_sum / max(count, 1.0)}
        if self.parts.classification:
            values["eval_accuracy"] = correct / max(count, 1.0)
        self.sink.report_values(self.step, self.epoch, values, reduced=True)  # all shards
        log.info("eval at step %d: %s", self.step, values)

    # -- checkpoints ---------------------------------------------------------------------------
    def _checkpoint(self, *, stall: bool = True) -> None:
        """Save a checkpoint now; with ``stall``, its wait counts as checkpoint stall."""
        epoch, step, batch_idx = self.epoch, self.step, self.batch_idx

        def build_state() -> dict[str, Any]:
            return {
                "format": CHECKPOINT_FORMAT,
                "model": self.bare.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "epoch": epoch,
                "step": step,
                "batch_idx": batch_idx,
                "sampler_epoch": epoch,
                "world_size": self.dist.world_size,
                "rng": rng_state(),
                "skipped_steps": self.nonfinite.skipped,
            }

        timed = self.ctx.facts.checkpoint_stall() if stall else contextlib.nullcontext()
        with self.watchdog.pause(), timed:  # a slow disk is not a stall of the watchdog
            self.checkpointer.save(step, epoch, build_state)

    def _resume(self, start: StartPoint) -> int | None:
        """Load ``start``; returns the step resumed at (None for an ``init_from`` start: its
        step is another job's, the final checkpoint is this job's own)."""
        with self.ctx.facts.restoring():
            state = load_checkpoint_file(start.path, self.dist.device)
            if start.kind == "init":
                self._init_from(state, start.mode)
                return None
            self.bare.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        restore_rng_state(state["rng"])
        self.epoch, self.step, self.batch_idx = state["epoch"], state["step"], state["batch_idx"]
        self.nonfinite.skipped = int(state.get("skipped_steps", 0))
        if state.get("world_size") != self.dist.world_size:
            log.warning(
                "resuming a checkpoint of world_size %s with %d ranks: the position within "
                "the epoch is approximate",
                state.get("world_size"),
                self.dist.world_size,
            )
        if self.batch_idx >= self.steps_per_epoch:
            self.epoch, self.batch_idx = self.epoch + 1, 0
        self.clock.restart(self.step)
        log.info(
            "resumed from %s: step %d, epoch %d, batch_idx %d",
            start.path,
            self.step,
            self.epoch,
            self.batch_idx,
        )
        return int(state["step"])

    def _init_from(self, state: dict[str, Any], mode: str) -> None:
        """Start from another job's checkpoint: its unwrapped model (any world size); with
        ``full`` also its optimizer state and step count (the position in the epoch follows
        from the step at this job's world size; RNG and sampler state stay this job's)."""
        if "model" not in state:
            raise ValueError(
                "init_from: the source checkpoint holds no 'model' entry (it was not written "
                "by a built-in task); load it in a custom loop with ctx.load_checkpoint()"
            )
        self.bare.load_state_dict(state["model"])
        if mode == "full":
            if "optimizer" in state:
                self.optimizer.load_state_dict(state["optimizer"])
            self.step = int(state.get("step", 0) or 0)
            self.epoch, self.batch_idx = divmod(self.step, self.steps_per_epoch)
        self.clock.restart(self.step)
        log.info("initialised from another job's checkpoint (%s): step %d", mode, self.step)
        if mode == "full" and self.step >= self.total_steps:
            log.warning("init_from step %d ≥ this job's %d steps: nothing to train",
                        self.step, self.total_steps)  # fmt: skip
            self.checkpointer.note_nothing_to_train(self.step, self.total_steps)
