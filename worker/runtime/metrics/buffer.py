"""What the training loop reports metrics to: the ``Sink`` protocol, the per-step buffer every
rank holds (``MetricsSink``), and ``NullSink``, the null object for ranks that record nothing.

``report`` only appends the detached loss tensor (no ``.item()``, no host sync). ``flush`` is
collective in the trainer: all ranks average the stacked buffer with one all_reduce, then
hand it to ``_publish``, which rank 0's ``worker.runtime.metrics.sink.ApiSink`` turns into
points for the attempt API.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

import torch

from service.core.metrics.points import RANK0_ONLY, JsonNumber, MetricPoint, json_safe
from service.core.wire.attempt import AttemptTimeline
from worker.runtime.distributed import DistContext, all_reduce_sum_

log = logging.getLogger(__name__)

# Flush after this many buffered points, or when FLUSH_INTERVAL_S passed (whichever first).
FLUSH_EVERY_POINTS = 500
FLUSH_INTERVAL_S = 2.0

# A buffered ``report``: (name, step, epoch, time_s), checked with its value when the batch is
# flushed; ``time_s`` (epoch seconds) is when it was reported, so a point's time is its step's.
Key = tuple[str, int, int | None, float]


@dataclass(frozen=True)
class Progress:
    """``jobs.progress``: where the job is and how fast it goes (samples/s over all ranks)."""

    step: int
    total_steps: int | None
    epoch: int | None
    samples_per_s: float | None
    eta_s: float | None

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe dict."""
        out = asdict(self)
        for key in ("samples_per_s", "eta_s"):
            out[key] = json_safe(out[key]) if out[key] is not None else None
        return out


class Sink(Protocol):
    """What the training loop (``Trainer``, ``TrainContext``) reports to, on every rank.

    ``make_sink`` builds the one for a rank: ``ApiSink`` on rank 0, the null object
    ``NullSink`` elsewhere; the loop never asks which rank it is. ``report``,
    ``report_values`` and ``buffered`` never sync with the device; ``flush`` with
    ``average=True`` is a collective.
    """

    latest: dict[str, float]

    def report(self, step: int, epoch: int | None, value: torch.Tensor, name: str = "loss") -> None:
        """Buffer one scalar tensor (no host sync)."""

    def report_values(
        self, step: int, epoch: int | None, values: Mapping[str, float], *, reduced: bool = False
    ) -> None:
        """Buffer host scalars; ``reduced``: already reduced over every rank."""

    def report_timeline(self, timeline: AttemptTimeline) -> None:
        """Hand rank 0's attempt facts (resume step, restore time, checkpoint stall) to the
        writer, which sends them before any later metric batch."""

    def hold_timeline(self, timeline: AttemptTimeline) -> None:
        """``report_timeline(timeline)`` once a point reported after now is flushed; never if
        none is (what happens after the last step is the attempt's teardown)."""

    def buffered(self, name: str) -> list[tuple[int, torch.Tensor]]:
        """The ``(step, tensor)`` pairs buffered under ``name`` since the last flush."""
        ...

    @property
    def pending(self) -> int:
        """Buffered points."""
        ...

    def flush_due(self) -> bool:
        """Enough points are buffered to flush (the same answer on every rank)."""
        ...

    def time_due(self) -> bool:
        """Points wait and the flush interval passed (this rank's clock)."""
        ...

    def flush(self, progress: Progress | None = None, *, average: bool = True) -> None:
        """Hand the buffer (and ``progress``) over; with ``average`` a collective."""

    def should_stop(self) -> bool:
        """The sink's writes were fenced off: the attempt is stale."""
        ...

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds until everything handed over is written; True
        when it is (at once on a rank that writes nothing), False on timeout."""
        ...

    def handed(self) -> int:
        """Points handed over to the writer so far: a watermark for ``wait_written``."""
        ...

    def wait_written(self, mark: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds until the first ``mark`` points handed over are
        written (or dropped for good); True when they are, False on timeout."""
        ...

    def close(self) -> None:
        """Write what was handed over and stop writing (after a final flush)."""

    def final_metrics(self) -> dict[str, JsonNumber] | None:
        """The newest value of every recorded metric; None on a rank that records nothing."""
        ...


class MetricsSink:
    """Buffers reports on every rank; ``_publish`` decides what happens to a flushed batch."""

    def __init__(self, ctx: DistContext | None) -> None:
        self._ctx = ctx
        self._keys: list[Key] = []
        self._tensors: list[torch.Tensor] = []
        self._host: list[MetricPoint] = []
        self._last_flush_s = time.monotonic()
        self._flushed_once = False
        self.latest: dict[str, float] = {}
        # ``hold_timeline``'s facts, oldest first, each with when it became true (epoch s).
        self._held: list[tuple[float, AttemptTimeline]] = []

    # -- called on the training thread, every step -------------------------------------------
    def report(self, step: int, epoch: int | None, value: torch.Tensor, name: str = "loss") -> None:
        """Buffer one scalar tensor (kept on its device); costs a list append, no host sync.
        Points are checked (``checked_point``) when rank 0 publishes the batch; a bad one is
        dropped there with a warning."""
        self._keys.append((name, step, epoch, time.time()))
        self._tensors.append(value.detach())

    def report_values(
        self, step: int, epoch: int | None, values: Mapping[str, float], *, reduced: bool = False
    ) -> None:
        """Buffer host scalars: with ``reduced``, values already reduced over every rank (e.g.
        eval metrics after an all_reduce), else rank 0's own (a custom loop's floats)."""
        at = datetime.fromtimestamp(time.time(), UTC)
        ranks = self._ranks(averaged=reduced)
        for name, value in values.items():
            self._host.append(MetricPoint(name, step, float(value), epoch, at, ranks))

    def report_timeline(self, timeline: AttemptTimeline) -> None:
        """Hand rank 0's attempt facts to the writer (only rank 0's ``ApiSink`` sends them)."""

    def hold_timeline(self, timeline: AttemptTimeline) -> None:
        """Keep ``timeline`` (cumulative facts, e.g. the checkpoint stall so far) until a
        flush hands over a point reported after now; then ``report_timeline`` it (the newest
        such one: each holds the ones before it). A checkpoint save after the attempt's last
        point is never told: it is teardown, not a stall inside the training window."""
        self._held.append((time.time(), timeline))

    def _release_held(self, keys: list[Key], host: list[MetricPoint]) -> None:
        """Report the newest held fact older than the newest point of a flushed batch."""
        newest = max((k[3] for k in keys), default=-math.inf)
        for p in host:
            if p.time is not None:
                newest = max(newest, p.time.timestamp())
        released = [t for at, t in self._held if at < newest]
        if released:
            self._held = [(at, t) for at, t in self._held if at >= newest]
            self.report_timeline(released[-1])

    def _ranks(self, *, averaged: bool) -> int:
        """``MetricPoint.ranks`` of a value: the world size when averaged (or on one rank),
        else ``RANK0_ONLY``."""
        world = self._ctx.world_size if self._ctx is not None else 1
        return world if averaged or world == 1 else RANK0_ONLY

    def buffered(self, name: str) -> list[tuple[int, torch.Tensor]]:
        """``(step, tensor)`` of every tensor buffered under ``name`` since the last flush (the
        tensors as reported, on their device: reading them is the caller's host sync)."""
        return [(k[1], t) for k, t in zip(self._keys, self._tensors, strict=True) if k[0] == name]

    @property
    def pending(self) -> int:
        """Buffered points (identical on every rank when every rank reports the same)."""
        return len(self._keys) + len(self._host)

    def flush_due(self) -> bool:
        """True when ``FLUSH_EVERY_POINTS`` tensors are buffered, or at the first ``report``
        (so the first loss shows on the dashboard one step after launch, not seconds later).
        Counts only ``report`` calls, which every rank makes alike, so every rank reaches the
        same answer at the same step."""
        if not self._flushed_once and self._keys:
            return True
        return len(self._keys) >= FLUSH_EVERY_POINTS

    def time_due(self) -> bool:
        """True when points wait and ``FLUSH_INTERVAL_S`` passed since the last flush (local
        clock: fold it into the stop vote so all ranks flush at the same step)."""
        waiting = bool(self._keys or self._host)  # ``pending`` without its call: every step
        return waiting and time.monotonic() - self._last_flush_s >= FLUSH_INTERVAL_S

    def flush(self, progress: Progress | None = None, *, average: bool = True) -> None:
        """Hand the buffer to ``_publish``. With ``average`` (the trainer), a collective: every
        rank must call it at the same point with the same buffered keys; tensor values are
        averaged over ranks with one all_reduce. Without, rank 0's own values are kept.

        Raises:
            Exception: the all_reduce failed (a peer died, e.g. while the job was stopping).
                The batch is handed over first, with this rank's own values unaveraged: a
                broken collective must not cost the steps it covers.
        """
        keys, tensors, host = self._keys, self._tensors, self._host
        self._keys, self._tensors, self._host = [], [], []
        if self._held:
            self._release_held(keys, host)
        self._flushed_once = self._flushed_once or bool(keys)
        self._last_flush_s = time.monotonic()
        stacked = _stacked(tensors) if tensors else None
        ctx = self._ctx
        if stacked is not None and average and ctx is not None and ctx.world_size > 1:
            local = stacked.clone()  # a few floats; all_reduce works in place
            try:
                all_reduce_sum_(stacked, ctx)
            except Exception:
                log.warning("metrics all_reduce failed: keeping %d points unaveraged",
                            len(keys))  # fmt: skip
                self._publish(keys, local, host, progress, self._ranks(averaged=False))
                raise
            stacked /= ctx.world_size
        self._publish(keys, stacked, host, progress, self._ranks(averaged=average))

    def should_stop(self) -> bool:
        """True when the sink's writes were fenced off (the attempt is stale)."""
        return False

    def drain(self, timeout_s: float) -> bool:
        """Nothing to wait for on a rank that writes nothing: True."""
        return True

    def handed(self) -> int:
        """Nothing is handed over on a rank that writes nothing: 0."""
        return 0

    def wait_written(self, mark: int, timeout_s: float) -> bool:
        """Nothing to wait for on a rank that writes nothing: True."""
        return True

    def close(self) -> None:
        """Write everything handed over so far and stop the writer (call after a final flush)."""

    def final_metrics(self) -> dict[str, JsonNumber] | None:
        """The newest value of every metric this rank recorded (JSON-safe), for result.json;
        None on a rank that records nothing."""
        return None

    def _publish(
        self,
        keys: list[Key],
        stacked: torch.Tensor | None,
        host: list[MetricPoint],
        progress: Progress | None,
        ranks: int,
    ) -> None:
        """Take a flushed batch: ``stacked`` holds the tensor values of ``keys`` (made over
        ``ranks`` ranks: ``MetricPoint.ranks``), ``host`` the host points."""
        raise NotImplementedError


class NullSink(MetricsSink):
    """The null ``Sink`` (ranks other than 0): takes part in the collective flush, keeps
    nothing, records nothing (``final_metrics`` is None)."""

    def _publish(
        self,
        keys: list[Key],
        stacked: torch.Tensor | None,
        host: list[MetricPoint],
        progress: Progress | None,
        ranks: int,
    ) -> None:
        return None


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One float32 vector of the buffered scalars, on the first one's device.

    Raises:
        RuntimeError: a tensor that is not a scalar (one element).
    """
    device = tensors[0].device
    try:  # the usual batch (same shape, dtype and device): one stack, not 2 ops per tensor
        stacked = torch.stack(tensors).to(device, torch.float32).reshape(-1)
    except RuntimeError:
        stacked = None
    if stacked is None or stacked.numel() != len(tensors):  # mixed: say which is wrong
        stacked = torch.stack([t.reshape(()).to(device, torch.float32) for t in tensors])
    return stacked
