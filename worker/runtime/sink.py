"""The metrics sink: per-step reports buffered on device, flushed in batches to the database.

Every rank holds a sink (``make_sink``): rank 0 a ``DatabaseSink``, the others a ``NullSink``
(both ``worker.runtime.sink_buffer.MetricsSink``s: ``report`` only appends the detached loss
tensor, no host sync). ``flush`` is collective in the trainer: all ranks average the stacked
buffer with one all_reduce, then rank 0 copies it to the host once and appends the points to
its backlog
(``worker.runtime.backlog``), which a background thread writes with
``service.store.metrics.record_metrics`` (one transaction per batch, duplicates ignored). While the
database is down the backlog grows (in memory, then in a spill file) and the thread retries
with backoff; training goes on.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from pathlib import Path

import torch

from service.core.artifacts import metrics_spill_path
from service.core.errors import DatabaseUnavailableError, NotFoundError, StaleAttemptError
from service.core.metric_points import JsonNumber, MetricPoint, json_safe, split_points
from service.store.db import Database
from service.store.metrics import record_metrics
from service.store.models import utcnow
from worker.runtime.backlog import MetricBacklog
from worker.runtime.distributed import DistContext
from worker.runtime.sink_buffer import Key, MetricsSink, NullSink, Progress, Sink

log = logging.getLogger(__name__)

# Points the writer puts in one transaction (an outage's backlog is replayed in such chunks).
WRITE_BATCH_POINTS = 1000
# Points held in memory while the writer is behind; newer ones spill to a file.
MEMORY_CAP_POINTS = 200_000
# Backoff between writes while the database is unavailable (seconds): doubles up to the max.
RETRY_FIRST_S = 0.25
RETRY_MAX_S = 5.0
# How long close() keeps retrying what is left before keeping it in the spill file (seconds).
CLOSE_TIMEOUT_S = 120.0
# While the database stays down, repeat the warning at most this often (seconds).
OUTAGE_LOG_EVERY_S = 30.0


class DatabaseSink(MetricsSink):
    """Rank 0: one host copy per flush; a background thread writes the backlog, fenced by
    attempt, and keeps it (memory, then a spill file) across database outages.

    The writer retries with exponential backoff (``RETRY_FIRST_S`` doubling to
    ``RETRY_MAX_S`` seconds) for as long as the attempt runs; training never waits for it.
    Every point is written exactly once by its (job, name, step) key: a batch whose commit
    outcome was lost with the connection is simply written again (duplicates are ignored).

    Args:
        spill_path: where points past ``memory_cap`` go (default: a file in the temp dir;
            ``make_sink`` passes the attempt's ``metrics_spill_path``).
        memory_cap: points held in memory before spilling.
        close_timeout_s: how long ``close`` keeps retrying what is left (seconds); after that
            the unsent points stay in the spill file and an error is logged.
    """

    def __init__(
        self,
        ctx: DistContext | None,
        db: Database,
        job_id: int,
        attempt: int,
        *,
        spill_path: Path | None = None,
        memory_cap: int = MEMORY_CAP_POINTS,
        close_timeout_s: float = CLOSE_TIMEOUT_S,
    ) -> None:
        super().__init__(ctx)
        self.db, self.job_id, self.attempt = db, job_id, attempt
        if spill_path is None:
            name = f"ddpq-metrics-{job_id}-{attempt}-{os.getpid()}.jsonl"
            spill_path = Path(tempfile.gettempdir()) / name
        self._backlog = MetricBacklog(spill_path, memory_cap)
        self._progress: Progress | None = None  # the newest one not written yet
        self._progress_lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._close_timeout_s = close_timeout_s
        self._stale = threading.Event()
        self._warned_repeats = False
        self._outage_since: float | None = None
        self._outage_logged_s = 0.0
        self.written = 0
        self.discarded = 0
        self._thread = threading.Thread(target=self._run, name="ddpq-metrics", daemon=True)
        self._thread.start()

    def should_stop(self) -> bool:
        return self._stale.is_set()

    @property
    def held_back(self) -> int:
        """Points handed over but not written yet (in memory or in the spill file)."""
        return len(self._backlog)

    @property
    def spill_path(self) -> Path:
        """The spill file (exists only while points wait in it)."""
        return self._backlog.spill_path

    @property
    def spilled_total(self) -> int:
        """Points that went through the spill file so far."""
        return self._backlog.spilled_total

    def _publish(
        self,
        keys: list[Key],
        stacked: torch.Tensor | None,
        host: list[MetricPoint],
        progress: Progress | None,
    ) -> None:
        now = utcnow()
        reported: list[MetricPoint] = []
        if stacked is not None:
            values = stacked.tolist()  # the one device→host copy of this batch
            reported = [
                MetricPoint(n, s, v, e, now) for (n, s, e), v in zip(keys, values, strict=True)
            ]
        reported.extend(host)
        points, refused = split_points(reported)
        if refused:  # one bad point (e.g. a 101-character name) must not stop the curve
            log.warning("%d metric points refused, the first: %s", len(refused), refused[0])
        for p in points:
            self.latest[p.name] = p.value
        if self._stale.is_set():
            return
        self._backlog.append(points)
        if progress is not None:
            with self._progress_lock:
                self._progress = progress
        if points or progress is not None:
            self._wake.set()

    def final_metrics(self) -> dict[str, JsonNumber] | None:
        return {k: json_safe(v) for k, v in self.latest.items()}

    def close(self) -> None:
        """Write everything handed over so far, then stop the writer. While the database is
        down it keeps retrying for up to ``close_timeout_s`` seconds; what is still unsent
        then is kept in the spill file (logged as an error). Idempotent."""
        self._closing.set()
        self._wake.set()
        self._thread.join()
        left = len(self._backlog)
        if left:
            try:
                kept = self._backlog.persist()
                log.error(
                    "%d metric points could not be written (database unavailable); kept in %s",
                    kept,
                    self.spill_path,
                )
            except OSError as exc:
                log.error("%d metric points could not be written nor kept: %s", left, exc)
        self._backlog.close()

    # -- the writer thread ---------------------------------------------------------------------
    def _run(self) -> None:
        failures = 0
        next_try_s = 0.0
        deadline_s: float | None = None
        while True:
            self._wake.wait(None if failures == 0 else max(0.0, next_try_s - time.monotonic()))
            self._wake.clear()
            closing = self._closing.is_set()  # read before writing: nothing newer can follow
            if closing and deadline_s is None:
                deadline_s = time.monotonic() + self._close_timeout_s
            elif failures and time.monotonic() < next_try_s:
                continue  # woken by a flush while backing off: the backlog just grows
            failures = 0 if self._write_backlog() else failures + 1
            now = time.monotonic()
            if closing and (failures == 0 or now >= (deadline_s or 0.0)):
                return
            next_try_s = now + retry_delay_s(max(failures, 1))

    def _write_backlog(self) -> bool:
        """Write the backlog oldest first, ``WRITE_BATCH_POINTS`` per transaction, with the
        newest progress. False when the database is unavailable (the rest stays queued)."""
        while not self._stale.is_set():
            batch = self._backlog.peek(WRITE_BATCH_POINTS)
            with self._progress_lock:
                progress = self._progress
            if not batch and progress is None:
                return True
            try:
                with self.db.session(one_statement=True) as session:
                    inserted = record_metrics(
                        session,
                        self.job_id,
                        self.attempt,
                        batch,
                        progress=progress.as_dict() if progress is not None else None,
                    )
            except (StaleAttemptError, NotFoundError) as exc:
                self._stale.set()
                self.discarded += self._backlog.discard()
                log.warning("metrics fenced off, stopping (%d points discarded): %s",
                            self.discarded, exc)  # fmt: skip
                return True
            except DatabaseUnavailableError as exc:
                self._note_outage(exc)
                return False
            except Exception:  # the thread must outlive any bad batch: keep it, retry later
                log.exception("metrics write failed; %d points kept", len(self._backlog))
                return False
            self._backlog.drop_oldest(len(batch))
            if inserted < len(batch) and not self._warned_repeats:
                self._warned_repeats = True  # once per attempt: a resume repeats steps too
                log.warning(
                    "%d of %d metric points had a (name, step) already stored and were ignored: "
                    "normal when steps are replayed after a resume; otherwise report a global "
                    "step that keeps growing across epochs",
                    len(batch) - inserted,
                    len(batch),
                )
            with self._progress_lock:
                if self._progress is progress:
                    self._progress = None
            self.written += len(batch)
            self._note_recovery()
        self.discarded += self._backlog.discard()
        return True

    def _note_outage(self, exc: DatabaseUnavailableError) -> None:
        now = time.monotonic()
        if self._outage_since is None:
            self._outage_since = now
        elif now - self._outage_logged_s < OUTAGE_LOG_EVERY_S:
            return
        self._outage_logged_s = now
        log.warning(
            "metrics writer: %s; holding %d points (%d in %s), retrying",
            exc,
            len(self._backlog),
            self._backlog.in_file,
            self.spill_path,
        )

    def _note_recovery(self) -> None:
        if self._outage_since is not None:
            log.info("metrics writer: database back after %.1f s; %d points still to replay",
                     time.monotonic() - self._outage_since, len(self._backlog))  # fmt: skip
            self._outage_since = None


def retry_delay_s(failures: int) -> float:
    """Seconds to wait after ``failures`` consecutive failed writes (≥ 1): exponential from
    ``RETRY_FIRST_S``, capped at ``RETRY_MAX_S``."""
    return float(min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** min(failures - 1, 16)))


def make_sink(
    rank: int,
    ctx: DistContext | None,
    db: Database,
    job_id: int,
    attempt: int,
    *,
    artifact_dir: Path | None = None,
) -> Sink:
    """The one place that decides who writes metrics: a DatabaseSink on rank 0, else the null
    object NullSink.

    With ``artifact_dir``, rank 0 spills to the attempt's ``metrics_spill_path`` there.
    """
    if rank == 0:
        spill = metrics_spill_path(artifact_dir, job_id, attempt) if artifact_dir else None
        return DatabaseSink(ctx, db, job_id, attempt, spill_path=spill)
    return NullSink(ctx)
