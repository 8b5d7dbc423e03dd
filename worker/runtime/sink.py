"""The metrics sink: per-step reports buffered on device, flushed in batches to the database.

Every rank holds a sink (``make_sink``): rank 0 a ``DatabaseSink``, the others a ``NullSink``.
``report`` only appends the detached loss tensor (no ``.item()``, no host sync). ``flush`` is
collective in the trainer: all ranks average the stacked buffer with one all_reduce, then rank
0 copies it to the host once and hands the batch to a background thread that writes it with
``service.metrics.record_metrics`` (one transaction per batch, duplicates ignored).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from service.db import Database
from service.errors import DatabaseUnavailableError, NotFoundError, StaleAttemptError
from service.metrics import MetricPoint, json_safe, record_metrics
from service.models import utcnow
from worker.runtime.distributed import DistContext, all_reduce_sum_
from worker.runtime.outcome import write_result

log = logging.getLogger(__name__)

# Flush after this many buffered points, or when FLUSH_INTERVAL_S passed (whichever first).
FLUSH_EVERY_POINTS = 50
FLUSH_INTERVAL_S = 2.0
# Batches waiting for the writer thread; beyond this the training loop keeps an overflow list.
QUEUE_BATCHES = 8
# Hard cap on points held back (overflow + failed writes); the oldest beyond it are dropped
# with a warning.
OVERFLOW_CAP_POINTS = 200_000


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


class MetricsSink:
    """Buffers reports on every rank; ``_publish`` decides what happens to a flushed batch."""

    def __init__(self, ctx: DistContext | None) -> None:
        self._ctx = ctx
        self._keys: list[tuple[str, int, int | None]] = []
        self._tensors: list[torch.Tensor] = []
        self._host: list[MetricPoint] = []
        self._last_flush_s = time.monotonic()
        self.latest: dict[str, float] = {}

    # -- called on the training thread, every step -------------------------------------------
    def report(self, step: int, epoch: int | None, value: torch.Tensor, name: str = "loss") -> None:
        """Buffer one scalar tensor (kept on its device); costs a list append, no host sync."""
        self._keys.append((name, step, epoch))
        self._tensors.append(value.detach())

    def report_values(self, step: int, epoch: int | None, values: Mapping[str, float]) -> None:
        """Buffer host scalars (e.g. eval metrics already reduced over ranks)."""
        for name, value in values.items():
            self._host.append(MetricPoint(name=name, step=step, value=float(value), epoch=epoch))

    @property
    def pending(self) -> int:
        """Buffered points (identical on every rank when every rank reports the same)."""
        return len(self._keys) + len(self._host)

    def flush_due(self) -> bool:
        """True when ``FLUSH_EVERY_POINTS`` tensors are buffered. Counts only ``report`` calls,
        which every rank makes alike, so every rank reaches the same answer at the same step."""
        return len(self._keys) >= FLUSH_EVERY_POINTS

    def time_due(self) -> bool:
        """True when points wait and ``FLUSH_INTERVAL_S`` passed since the last flush (local
        clock: fold it into the stop vote so all ranks flush at the same step)."""
        return self.pending > 0 and time.monotonic() - self._last_flush_s >= FLUSH_INTERVAL_S

    def flush(self, progress: Progress | None = None, *, average: bool = True) -> None:
        """Hand the buffer to ``_publish``. With ``average`` (the trainer), a collective: every
        rank must call it at the same point with the same buffered keys; tensor values are
        averaged over ranks with one all_reduce. Without, rank 0's own values are kept."""
        keys, tensors, host = self._keys, self._tensors, self._host
        self._keys, self._tensors, self._host = [], [], []
        self._last_flush_s = time.monotonic()
        stacked: torch.Tensor | None = None
        if tensors:
            device = tensors[0].device
            stacked = torch.stack([t.reshape(()).to(device, torch.float32) for t in tensors])
            if average and self._ctx is not None and self._ctx.world_size > 1:
                all_reduce_sum_(stacked, self._ctx)
                stacked /= self._ctx.world_size
        self._publish(keys, stacked, host, progress)

    def should_stop(self) -> bool:
        """True when the sink's writes were fenced off (the attempt is stale)."""
        return False

    def close(self) -> None:
        """Write everything handed over so far and stop the writer (call after a final flush)."""

    def write_result(
        self, artifact_dir: Path, *, step: int, checkpoint: str | None, extra: Mapping[str, Any]
    ) -> None:
        """Rank 0 writes result.json (``final_metrics``: the newest value of every metric,
        plus ``extra``); other ranks do nothing. Call after ``close`` and before teardown."""

    def _publish(
        self,
        keys: list[tuple[str, int, int | None]],
        stacked: torch.Tensor | None,
        host: list[MetricPoint],
        progress: Progress | None,
    ) -> None:
        raise NotImplementedError


class NullSink(MetricsSink):
    """Ranks other than 0: take part in the collective flush, keep nothing."""

    def _publish(
        self,
        keys: list[tuple[str, int, int | None]],
        stacked: torch.Tensor | None,
        host: list[MetricPoint],
        progress: Progress | None,
    ) -> None:
        return None


_CLOSE = object()


class DatabaseSink(MetricsSink):
    """Rank 0: one host copy per flush; a background thread writes batches, fenced by attempt."""

    def __init__(
        self,
        ctx: DistContext | None,
        db: Database,
        job_id: int,
        attempt: int,
        *,
        queue_batches: int = QUEUE_BATCHES,
        overflow_cap: int = OVERFLOW_CAP_POINTS,
    ) -> None:
        super().__init__(ctx)
        self._db, self.job_id, self.attempt = db, job_id, attempt
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_batches)
        self._overflow: list[MetricPoint] = []
        self._overflow_progress: Progress | None = None
        self._overflow_cap = overflow_cap
        self._failed: list[MetricPoint] = []
        self._failed_lock = threading.Lock()
        self._stale = threading.Event()
        self.dropped = 0
        self.written = 0
        self._thread = threading.Thread(target=self._run, name="ddpq-metrics", daemon=True)
        self._thread.start()

    def should_stop(self) -> bool:
        return self._stale.is_set()

    @property
    def held_back(self) -> int:
        """Points kept in the overflow list because the writer's queue was full."""
        return len(self._overflow)

    def _publish(
        self,
        keys: list[tuple[str, int, int | None]],
        stacked: torch.Tensor | None,
        host: list[MetricPoint],
        progress: Progress | None,
    ) -> None:
        now = utcnow()
        points: list[MetricPoint] = []
        if stacked is not None:
            values = stacked.tolist()  # the one device→host copy of this batch
            points = [
                MetricPoint(name=n, step=s, value=v, epoch=e, time=now)
                for (n, s, e), v in zip(keys, values, strict=True)
            ]
        points.extend(host)
        for p in points:
            self.latest[p.name] = p.value
        if self._stale.is_set():
            return
        with self._failed_lock:
            failed, self._failed = self._failed, []
        batch = self._cap(failed + self._overflow + points)
        progress = progress or self._overflow_progress
        self._overflow, self._overflow_progress = [], None
        if not batch and progress is None:
            return
        try:
            self._queue.put_nowait((batch, progress))
        except queue.Full:  # never block training: keep it for the next flush
            self._overflow, self._overflow_progress = batch, progress

    def _cap(self, batch: list[MetricPoint]) -> list[MetricPoint]:
        excess = len(batch) - self._overflow_cap
        if excess <= 0:
            return batch
        self.dropped += excess
        log.warning(
            "metrics writer is behind: dropping the %d oldest of %d held-back points "
            "(%d dropped so far)",
            excess,
            len(batch),
            self.dropped,
        )
        return batch[excess:]

    def write_result(
        self, artifact_dir: Path, *, step: int, checkpoint: str | None, extra: Mapping[str, Any]
    ) -> None:
        final: dict[str, Any] = {k: json_safe(v) for k, v in self.latest.items()}
        for key, value in extra.items():
            final[key] = json_safe(float(value)) if isinstance(value, int | float) else value
        path = write_result(
            artifact_dir,
            self.job_id,
            self.attempt,
            step=step,
            final_metrics=final,
            checkpoint=checkpoint,
        )
        log.info("result written to %s", path)

    def close(self) -> None:
        if self._overflow or self._overflow_progress is not None or self._failed:
            with self._failed_lock:
                failed, self._failed = self._failed, []
            self._queue.put((failed + self._overflow, self._overflow_progress))
            self._overflow, self._overflow_progress = [], None
        self._queue.put(_CLOSE)
        self._thread.join()
        if self._failed:
            log.error("%d metric points could not be written", len(self._failed))

    # -- the writer thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                return
            batch, progress = item
            if not self._stale.is_set():
                self._write(batch, progress, retry_now=self._queue.empty())

    def _write(self, batch: list[MetricPoint], progress: Progress | None, retry_now: bool) -> None:
        for attempt_no in range(3 if retry_now else 1):
            try:
                with self._db.session() as session:
                    record_metrics(
                        session,
                        self.job_id,
                        self.attempt,
                        batch,
                        progress=progress.as_dict() if progress is not None else None,
                    )
                self.written += len(batch)
                return
            except (StaleAttemptError, NotFoundError) as exc:
                log.warning("metrics fenced off, stopping: %s", exc)
                self._stale.set()
                return
            except DatabaseUnavailableError as exc:
                log.warning("metrics write failed (try %d): %s", attempt_no + 1, exc)
                time.sleep(0.5 * (attempt_no + 1))
        with self._failed_lock:  # merged into the next batch by the training thread
            self._failed = batch + self._failed


def make_sink(
    rank: int, ctx: DistContext | None, db: Database, job_id: int, attempt: int
) -> MetricsSink:
    """The one place that decides who writes metrics: a DatabaseSink on rank 0, else a NullSink."""
    if rank == 0:
        return DatabaseSink(ctx, db, job_id, attempt)
    return NullSink(ctx)
