"""Snapshot buffers for checkpoints: host copies of a state's tensors, allocated once, reused.

The training thread must be blocked only while a consistent copy of the state is taken; the
background writer then serialises that copy. Allocating fresh host tensors on every save costs
a page fault per 4 KiB page on top of the copy (measured 3.5–5× slower than copying into
buffers reused across saves, 400 MiB on CPU; docs/benchmarks.md #2). So ``SnapshotPool`` keeps
one host buffer per tensor of the state, keyed by the state's structure (paths, shapes, dtypes),
and ``copy_``\\ s into them. On a CUDA machine the buffers are pinned and the device→host copies
are ``non_blocking`` on the current stream; the ``Snapshot`` records a CUDA event that the
writer thread waits on before it reads (stream order keeps later optimizer steps from changing
the values before they are copied).

Memory: one host copy of the state (bytes = the state's tensor bytes), held while the pool
lives. The caller guarantees a snapshot is no longer read before taking the next one (the
``Checkpointer`` waits for its previous write first), so one set of buffers is enough.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

# (path, shape, dtype, device type) of every tensor, in traversal order.
Layout = tuple[tuple[str, tuple[int, ...], torch.dtype, str], ...]


def snapshot_to_cpu(obj: Any) -> Any:
    """A deep copy of ``obj`` with every tensor copied to fresh CPU memory (detached), so
    training can go on mutating its parameters while the copy is written. Allocates on every
    call; ``SnapshotPool`` reuses its buffers instead."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [snapshot_to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(snapshot_to_cpu(v) for v in obj)
    return copy.deepcopy(obj)


def _poolable(tensor: torch.Tensor) -> bool:
    """Dense tensors get a reused buffer; sparse/quantized/meta ones are copied the old way."""
    return (
        tensor.layout == torch.strided and not tensor.is_quantized and tensor.device.type != "meta"
    )


def state_layout(obj: Any) -> Layout:
    """The structure key of ``obj``: every poolable tensor's path, shape, dtype, device type."""
    found: list[tuple[str, tuple[int, ...], torch.dtype, str]] = []

    def visit(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            if _poolable(value):
                found.append((path, tuple(value.shape), value.dtype, value.device.type))
        elif isinstance(value, dict):
            for k, v in value.items():
                visit(v, f"{path}/{k!r}")
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                visit(v, f"{path}/{i}")

    visit(obj, "")
    return tuple(found)


@dataclass
class Snapshot:
    """A host copy of a state. ``state`` may still be filling from a GPU: call ``wait()``
    (in the thread that reads it) before serialising it."""

    state: Any
    ready: torch.cuda.Event | None = None

    def wait(self) -> None:
        """Block until every device→host copy of this snapshot has landed."""
        if self.ready is not None:
            self.ready.synchronize()


class SnapshotPool:
    """Host buffers for the tensors of one state structure, reused across snapshots.

    Args:
        pin_memory: page-lock the buffers (default: when CUDA is available), so device→host
            copies run asynchronously at full bus speed.
    """

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._layout: Layout | None = None
        self._buffers: list[torch.Tensor] = []
        self.allocations = 0  # how many times buffers were (re)allocated

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def release(self) -> None:
        """Drop the buffers (the next snapshot allocates again)."""
        self._layout, self._buffers = None, []

    def snapshot(self, state: Any) -> Snapshot:
        """Copy ``state`` into the pool's buffers: tensors ``copy_``-ed (non_blocking from a
        GPU), everything else deep-copied. Reallocates when the structure changed (e.g. the
        optimizer grew state after its first step).

        The returned snapshot aliases the buffers: it is valid until the next call.
        """
        layout = state_layout(state)
        if layout != self._layout:
            self._allocate(layout)
        fill: Callable[[torch.Tensor], torch.Tensor] = self._filler()
        out = _rebuild(state, fill)
        ready = None
        if any(device == "cuda" for *_, device in layout):
            ready = torch.cuda.Event()
            ready.record()  # on the current stream, after the copies queued on it
        return Snapshot(out, ready)

    def _allocate(self, layout: Layout) -> None:
        self._buffers = []  # free the old ones first: at most one set alive
        self._buffers = [
            torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.pin_memory)
            for _, shape, dtype, _ in layout
        ]
        self._layout = layout
        self.allocations += 1
        log.info("snapshot buffers allocated: %d tensors, %d bytes", len(layout), self.nbytes)

    def _filler(self) -> Callable[[torch.Tensor], torch.Tensor]:
        buffers = iter(self._buffers)

        def fill(tensor: torch.Tensor) -> torch.Tensor:
            if not _poolable(tensor):
                return tensor.detach().to("cpu", copy=True)
            buf = next(buffers)
            with torch.no_grad():
                buf.copy_(tensor.detach(), non_blocking=tensor.device.type == "cuda")
            return buf

        return fill


def _rebuild(obj: Any, fill: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with tensors replaced by ``fill(tensor)``, in the order ``state_layout`` walks."""
    if isinstance(obj, torch.Tensor):
        return fill(obj)
    if isinstance(obj, dict):
        return {k: _rebuild(v, fill) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v, fill) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_rebuild(v, fill) for v in obj)
    return copy.deepcopy(obj)
