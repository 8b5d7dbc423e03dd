"""Process group setup/teardown, device choice, model wrapping, samplers and the stop vote."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, DistributedSampler

from service.core.spec.model import JobSpec
from worker.runtime.topology import RankEnv

log = logging.getLogger(__name__)
T_co = TypeVar("T_co", covariant=True)


@dataclass(frozen=True)
class DistContext:
    """Where this rank computes and whom it talks to.

    ``control_group`` is a gloo group for small CPU-side collectives (stop votes, resume
    step) so they never need a device sync; None when there is no process group (strategy dp).
    """

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    strategy: str
    backend: str | None
    control_group: Any | None = None

    @property
    def is_distributed(self) -> bool:
        """True when a process group is up (strategy ddp)."""
        return self.backend is not None and dist.is_available() and dist.is_initialized()

    @property
    def on_gpu(self) -> bool:
        """True when this rank computes on a CUDA device."""
        return self.device.type == "cuda"


def select_device(spec: JobSpec, local_rank: int) -> torch.device:
    """``cuda:<local_rank>`` (made current) when the job has GPUs and CUDA is available, else
    CPU. Strategy dp uses ``cuda:0`` as DataParallel's output device."""
    if spec.resources.gpus_per_node > 0 and torch.cuda.is_available():
        index = 0 if spec.strategy == "dp" else local_rank
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_distributed(spec: JobSpec, env: RankEnv) -> DistContext:
    """Set threads and device and, for strategy ddp, join the process group (env://).

    The process group's timeout is ``env.pg_timeout_s`` seconds: a collective blocked longer
    than that (a dead or hung peer) raises instead of hanging forever.
    """
    torch.set_num_threads(spec.resources.cpus_per_task)
    device = select_device(spec, env.local_rank)
    if spec.strategy == "dp":
        return DistContext(0, 0, 1, device, "dp", None)
    backend = spec.resolved_backend
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=env.pg_timeout_s),
        **kwargs,
    )
    control = dist.new_group(backend="gloo")
    log.info(
        "process group up: backend=%s world_size=%d device=%s", backend, env.world_size, device
    )
    return DistContext(env.rank, env.local_rank, env.world_size, device, "ddp", backend, control)


def shutdown_distributed(ctx: DistContext) -> None:
    """Destroy the process group if one is up (call after result.json is written)."""
    if ctx.is_distributed:
        dist.destroy_process_group()


def wrap_model(model: nn.Module, ctx: DistContext) -> nn.Module:
    """Move ``model`` to the rank's device and wrap it: DDP (``device_ids`` on GPU only) for
    strategy ddp, ``nn.DataParallel`` for dp (on CPU it simply runs the module). Build the
    optimizer on the returned module."""
    model = model.to(ctx.device)
    if ctx.strategy == "dp":
        return nn.DataParallel(model)
    if ctx.is_distributed:
        if ctx.on_gpu:
            return DistributedDataParallel(model, device_ids=[ctx.device.index])
        return DistributedDataParallel(model)
    return model


def unwrap_model(model: nn.Module) -> nn.Module:
    """The bare module inside a DDP / DataParallel wrapper (itself when not wrapped)."""
    if isinstance(model, DistributedDataParallel | nn.DataParallel):
        inner = model.module
        assert isinstance(inner, nn.Module)
        return inner
    return model


class ResumableDistributedSampler(DistributedSampler[T_co]):
    """A DistributedSampler that can start mid-epoch: set ``start_index`` (samples of this
    rank to skip, i.e. ``batch_idx × batch_size``) before iterating; reset it to 0 after."""

    def __init__(
        self, dataset: Dataset[T_co], *, num_replicas: int, rank: int, shuffle: bool, seed: int
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.start_index = 0

    def __iter__(self) -> Iterator[T_co]:
        return itertools.islice(super().__iter__(), self.start_index, None)

    def __len__(self) -> int:
        return max(0, self.num_samples - self.start_index)


def make_sampler(
    dataset: Dataset[Any], ctx: DistContext, *, seed: int, shuffle: bool = True
) -> ResumableDistributedSampler[Any]:
    """This rank's shard of ``dataset``, reshuffled per epoch from ``seed`` (call set_epoch)."""
    assert isinstance(dataset, Sized), "datasets must have a length"
    return ResumableDistributedSampler(
        dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=shuffle, seed=seed
    )


def all_reduce_sum_(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place on the default group (no-op without one)."""
    if ctx.is_distributed and ctx.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_int(value: int, ctx: DistContext, src: int = 0) -> int:
    """Rank ``src``'s ``value`` on every rank (over the gloo control group)."""
    if not ctx.is_distributed or ctx.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(t, src=src, group=ctx.control_group)
    return int(t.item())


@dataclass(frozen=True)
class Decision:
    """What every rank agreed on at a step boundary."""

    stop: bool = False
    flush: bool = False


class StopVote:
    """A per-step collective decision to stop (or to flush metrics), without a per-step stall.

    Each ``poll`` waits for the previous step's non-blocking MAX all_reduce of
    ``[stop, flush]`` over the gloo control group (long finished by then), returns its result
    and starts the next one. So every rank acts on the same step, one step after the first rank
    raised its flag, and no rank is left waiting in a collective that a stopped peer skips.
    """

    def __init__(self, ctx: DistContext) -> None:
        self._ctx = ctx
        self._pending: tuple[Any, torch.Tensor] | None = None

    @property
    def _local(self) -> bool:
        return not self._ctx.is_distributed or self._ctx.world_size == 1

    def poll(self, stop: bool, flush: bool) -> Decision:
        """``collect`` the previous vote's decision, then ``launch`` this rank's flags (without
        peers: this rank's flags, at once)."""
        if self._local:
            return Decision(stop, flush)
        decision = self.collect()
        self.launch(stop, flush)
        return decision

    def collect(self) -> Decision:
        """The decision of the vote launched at the previous step boundary (same on all
        ranks); an empty decision when none is pending."""
        if self._pending is None:
            return Decision()
        work, flags = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        stop, flush = flags.tolist()
        return Decision(stop > 0, flush > 0)

    def launch(self, stop: bool, flush: bool) -> None:
        """Start this step's vote (non-blocking). Without peers the flags are kept as they are
        and come back from the next ``collect``."""
        flags = torch.tensor([float(stop), float(flush)])
        if self._local:
            self._pending = (None, flags)
            return
        work = dist.all_reduce(
            flags, op=dist.ReduceOp.MAX, group=self._ctx.control_group, async_op=True
        )
        self._pending = (work, flags)

    def close(self) -> Decision:
        """Wait for the last vote (every rank must call this at the same point)."""
        return self.collect()
