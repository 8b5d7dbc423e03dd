"""The metrics sink: per-step reports buffered on device, flushed in batches to the attempt API.

Every rank holds a sink (``make_sink``): rank 0 an ``ApiSink``, the others a ``NullSink``
(both ``worker.runtime.metrics.buffer.MetricsSink``s: ``report`` only appends the detached loss
tensor, no host sync). ``flush`` is collective in the trainer: all ranks average the stacked
buffer with one all_reduce, then rank 0 copies it to the host once and appends the points to
its backlog (``worker.runtime.metrics.backlog``), which a background thread posts to
``POST /attempts/self/metrics`` (``worker.runtime.attempt_client``), ``WRITE_BATCH_POINTS``
compact rows per request with the newest progress. While the API is unreachable (or answers
5xx/429) the backlog grows (in memory, then in a spill file) and the thread retries with
backoff, honouring ``Retry-After``; training goes on.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

from service.core.artifacts import metrics_spill_path
from service.core.errors import StaleAttemptError
from service.core.metrics.points import (
    JsonNumber,
    MetricPoint,
    json_safe,
    split_points,
)
from service.core.wire.attempt import AttemptTimeline
from worker.runtime.attempt_client import ApiUnavailableError, AttemptClient, AttemptRequestError
from worker.runtime.distributed import DistContext
from worker.runtime.metrics.backlog import MetricBacklog, metric_batch
from worker.runtime.metrics.buffer import Key, MetricsSink, NullSink, Progress, Sink
from worker.runtime.metrics.names import NameQuota, answered_names, is_names_refusal
from worker.runtime.topology import RankEnv

log = logging.getLogger(__name__)

# Points the writer puts in one request (an outage's backlog is replayed in such chunks).
WRITE_BATCH_POINTS = 1000
# Points held in memory while the writer is behind; newer ones spill to a file.
MEMORY_CAP_POINTS = 200_000
# Backoff between writes while the API is unavailable (seconds): doubles up to the max.
RETRY_FIRST_S = 0.25
RETRY_MAX_S = 5.0
# How long close() keeps retrying what is left before keeping it in the spill file (seconds).
CLOSE_TIMEOUT_S = 120.0
# While the API stays unavailable, repeat the warning at most this often (seconds).
OUTAGE_LOG_EVERY_S = 30.0
# How often ``drain`` looks at the backlog (seconds): a stop waits at most this much longer.
DRAIN_POLL_S = 0.01


class ApiSink(MetricsSink):
    """Rank 0: one host copy per flush; a background thread posts the backlog to the attempt
    API and keeps it (memory, then a spill file) while the API is unavailable.

    The writer retries with exponential backoff (``RETRY_FIRST_S`` doubling to
    ``RETRY_MAX_S`` seconds, or the server's ``Retry-After`` when longer) for as long as the
    attempt runs; training never waits for it. Every point is stored exactly once by its
    (job, name, step) key: a batch whose answer was lost (a timeout, a reset) is simply sent
    again, and the API ignores the duplicates. A 401/409 answer is the fence: the backlog is
    discarded and ``should_stop`` turns true. A 422 (a batch the API can never take) is
    logged and dropped, so one bad batch cannot block the rest; one past the job's name quota
    is sent again without its new names (``worker.runtime.metrics.names``).

    Args:
        client: the attempt API client; the sink closes it in ``close``.
        spill_path: where points past ``memory_cap`` go (default: a file in the temp dir;
            ``make_sink`` passes the attempt's ``metrics_spill_path``).
        memory_cap: points held in memory before spilling.
        close_timeout_s: how long ``close`` keeps retrying what is left (seconds); after that
            the unsent points stay in the spill file and an error is logged.
    """

    def __init__(
        self,
        ctx: DistContext | None,
        client: AttemptClient,
        *,
        spill_path: Path | None = None,
        memory_cap: int = MEMORY_CAP_POINTS,
        close_timeout_s: float = CLOSE_TIMEOUT_S,
    ) -> None:
        super().__init__(ctx)
        self.client = client
        if spill_path is None:
            name = f"ddpq-metrics-{os.getpid()}-{id(self):x}.jsonl"
            spill_path = Path(tempfile.gettempdir()) / name
        self._backlog = MetricBacklog(spill_path, memory_cap)
        self._progress: Progress | None = None  # the newest one not written yet
        self._timeline: AttemptTimeline | None = None  # facts not written yet (merged)
        self._progress_lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._close_timeout_s = close_timeout_s
        self._stale = threading.Event()
        self._warned_repeats = False
        self._outage_since: float | None = None
        self._outage_logged_s = 0.0
        self._retry_after_s: float | None = None  # the server's hint for the next try
        self.written = 0
        self.discarded = 0
        # Points handed to the backlog, and those of them settled (written or dropped for
        # good): the backlog is sent oldest first, so settled ≥ n means the first n are done.
        self._handed = 0
        self._settled = 0
        # Points dropped from a refused batch (names past the quota), settled only once the
        # ``_put_back`` points sent in its place are: settled ≥ n must mean the first n are.
        self._unsettled = 0
        self._put_back = 0
        self.refused = 0  # points the API refused (logged; a bad row never fails a batch)
        self.names = NameQuota()
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
        ranks: int,
    ) -> None:
        reported: list[MetricPoint] = []
        if stacked is not None:
            values = stacked.tolist()  # the one device→host copy of this batch
            stamp = datetime.fromtimestamp
            reported = [
                MetricPoint(n, s, v, e, stamp(t, UTC), ranks)
                for (n, s, e, t), v in zip(keys, values, strict=True)
            ]
        reported.extend(host)
        points, refused = split_points(reported)
        if refused:  # one bad point (e.g. a 101-character name) must not stop the curve
            log.warning("%d metric points refused, the first: %s", len(refused), refused[0])
        for p in points:
            self.latest[p.name] = p.value
        if self._stale.is_set():
            return
        points = self.names.admit(points)
        self._backlog.append(points)
        self._handed += len(points)
        if progress is not None:
            with self._progress_lock:
                self._progress = progress
        if points or progress is not None:
            self._wake.set()

    def final_metrics(self) -> dict[str, JsonNumber] | None:
        return {k: json_safe(v) for k, v in self.latest.items()}

    def report_timeline(self, timeline: AttemptTimeline) -> None:
        """Queue ``timeline`` (merged into facts not written yet: newer fields win); the
        writer sends it before the next metric batch, so a resume step told before the first
        report reaches the API before any of the attempt's points."""
        with self._progress_lock:
            pending = self._timeline
            if pending is not None:
                merged = pending.model_dump() | timeline.model_dump(exclude_none=True)
                timeline = AttemptTimeline.model_construct(**merged)
            self._timeline = timeline
        self._wake.set()

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds until the writer has stored every point and the
        progress handed over so far (or the attempt was fenced off: nothing more will be).

        A stop checkpoint must come after the points it covers are stored: the next attempt
        resumes after the checkpoint's step, so a point still in memory when the process is
        killed would never be written. The writer keeps its own pace (backoff during an
        outage); this only waits for it.

        Returns:
            True when nothing is left to write, False when ``timeout_s`` passed first.
        """

        def idle() -> bool:
            with self._progress_lock:
                return self._progress is None and self._timeline is None and not self._backlog

        return self._wait_until(idle, timeout_s)

    def handed(self) -> int:
        return self._handed

    def wait_written(self, mark: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds until the first ``mark`` points handed over are
        written or dropped for good (refused, fenced off): a checkpoint at step S is recorded
        only once the points up to S are stored, since the next attempt resumes after S.

        Returns:
            True when they are (or the attempt was fenced off), False when ``timeout_s``
            passed first or the writer died.
        """
        return self._wait_until(lambda: self._settled >= mark, timeout_s)

    def _wait_until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Wake the writer and poll ``done`` until it holds, the attempt is fenced off
        (nothing more will be written), or ``timeout_s`` seconds pass or the writer died
        (False)."""
        deadline_s = time.monotonic() + timeout_s
        self._wake.set()
        while not (self._stale.is_set() or done()):
            if time.monotonic() >= deadline_s or not self._thread.is_alive():
                return False
            time.sleep(DRAIN_POLL_S)
        return True

    def close(self) -> None:
        """Write everything handed over so far, then stop the writer and close the client.
        While the API is unavailable it keeps retrying for up to ``close_timeout_s`` seconds;
        what is still unsent then is kept in the spill file (logged as an error). Idempotent."""
        self._closing.set()
        self._wake.set()
        self._thread.join()
        left = len(self._backlog)
        if left:
            try:
                kept = self._backlog.persist()
                log.error(
                    "%d metric points could not be written (attempt API unavailable); kept in %s",
                    kept,
                    self.spill_path,
                )
            except OSError as exc:
                log.error("%d metric points could not be written nor kept: %s", left, exc)
        self._backlog.close()
        self.client.close()

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
            if failures and time.monotonic() < next_try_s:
                continue  # woken while backing off (a flush, close): keep the server's pace
            failures = 0 if self._write_backlog() else failures + 1
            now = time.monotonic()
            if closing and (failures == 0 or now >= (deadline_s or 0.0)):
                return
            delay_s = retry_delay_s(max(failures, 1))
            if self._retry_after_s is not None:  # back-pressure: the server knows better
                delay_s = max(delay_s, self._retry_after_s)
            next_try_s = now + delay_s
            if closing and deadline_s is not None:
                next_try_s = min(next_try_s, deadline_s)

    def _write_backlog(self) -> bool:
        """Send the backlog oldest first, ``WRITE_BATCH_POINTS`` per request, with the newest
        progress. False when the API is unavailable (the rest stays queued)."""
        while not self._stale.is_set():
            if not self._write_timeline():
                return False
            batch = self._backlog.peek(WRITE_BATCH_POINTS)
            with self._progress_lock:
                progress = self._progress
            if not batch and progress is None:
                return True
            try:
                ack = self.client.send_metrics(metric_batch(batch, progress))
            except StaleAttemptError as exc:
                self._stale.set()
                self.discarded += self._backlog.discard()
                log.warning("metrics fenced off, stopping (%d points discarded): %s",
                            self.discarded, exc)  # fmt: skip
                return True
            except ApiUnavailableError as exc:
                self._retry_after_s = exc.retry_after_s
                self._note_outage(exc)
                return False
            except AttemptRequestError as exc:  # resending the same batch cannot help
                if is_names_refusal(exc.answer_code, str(exc)):
                    again = self.names.refused(batch, answered_names(exc.answer))
                    if again:  # sent next in the batch's place
                        self._backlog.replace_oldest(len(batch), again)
                        # The dropped points count as done once the ones put back are.
                        self._unsettled += len(batch) - len(again)
                        self._put_back = max(self._put_back - len(batch), 0) + len(again)
                        continue
                    # Only names past the quota: dropped (counted in ``names.dropped``).
                else:
                    log.error("metrics batch of %d points refused by the API, dropped: %s",
                              len(batch), exc)  # fmt: skip
                    self.discarded += len(batch)
                inserted = len(batch)
            except Exception:  # the thread must outlive any bad batch: keep it, retry later
                log.exception("metrics write failed; %d points kept", len(self._backlog))
                self._retry_after_s = None
                return False
            else:
                inserted = ack.inserted
                self.names.note_stored(batch)
                self._note_ack(len(batch), ack.accepted, ack.refused)
                self.written += ack.accepted
            self._retry_after_s = None
            self._backlog.drop_oldest(len(batch))
            self._settle(len(batch))
            with self._progress_lock:
                if self._progress is progress:
                    self._progress = None
            self._note_repeats(len(batch), inserted)
            self._note_recovery()
        self.discarded += self._backlog.discard()
        return True

    def _settle(self, count: int) -> None:
        """The ``count`` oldest points are written or dropped for good."""
        self._settled += count
        if self._unsettled:
            self._put_back -= count
            if self._put_back <= 0:
                self._settled += self._unsettled
                self._unsettled = self._put_back = 0

    def _write_timeline(self) -> bool:
        """Send the pending timeline facts first (they may supersede earlier attempts'
        points). False when the API is unavailable (they stay pending; batches wait)."""
        with self._progress_lock:
            timeline = self._timeline
        if timeline is None:
            return True
        try:
            self.client.send_timeline(timeline)
        except StaleAttemptError as exc:
            self._stale.set()
            self.discarded += self._backlog.discard()
            log.warning("attempt timeline fenced off, stopping: %s", exc)
        except ApiUnavailableError as exc:
            self._retry_after_s = exc.retry_after_s
            self._note_outage(exc)
            return False
        except AttemptRequestError as exc:  # resending cannot help (e.g. an older API)
            log.error("attempt timeline refused by the API, dropped: %s", exc)
        with self._progress_lock:
            if self._timeline is timeline:
                self._timeline = None
        return True

    def _note_ack(self, sent: int, accepted: int, refused: list[str]) -> None:
        if accepted < sent:
            self.refused += sent - accepted
            log.warning("%d of %d metric points refused by the API, the first: %s",
                        sent - accepted, sent, refused[0] if refused else "?")  # fmt: skip

    def _note_repeats(self, sent: int, inserted: int) -> None:
        if inserted < sent and not self._warned_repeats:
            self._warned_repeats = True  # once per attempt: a resume repeats steps too
            log.warning(
                "%d of %d metric points had a (name, step) already stored and were ignored: "
                "normal when steps are replayed after a resume or a resend; otherwise report a "
                "global step that keeps growing across epochs",
                sent - inserted,
                sent,
            )

    def _note_outage(self, exc: ApiUnavailableError) -> None:
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
            log.info("metrics writer: attempt API back after %.1f s; %d points still to replay",
                     time.monotonic() - self._outage_since, len(self._backlog))  # fmt: skip
            self._outage_since = None


def retry_delay_s(failures: int) -> float:
    """Seconds to wait after ``failures`` consecutive failed writes (≥ 1): exponential from
    ``RETRY_FIRST_S``, capped at ``RETRY_MAX_S``."""
    return float(min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** min(failures - 1, 16)))


def make_sink(
    env: RankEnv, ctx: DistContext | None, *, artifact_dir: Path | None = None, writer: str = ""
) -> Sink:
    """The one place that decides who writes metrics: an ApiSink on rank 0 (with its own
    ``AttemptClient`` for ``env.api_url`` and ``env.attempt_token``), else the null object
    NullSink.

    With ``artifact_dir``, rank 0 spills to the attempt's ``metrics_spill_path`` there
    (``writer`` names a second writer's own file).
    """
    if env.rank == 0:
        client = AttemptClient(env.api_url, env.attempt_token)
        spill = (
            metrics_spill_path(artifact_dir, env.job_id, env.attempt, writer)
            if artifact_dir
            else None
        )
        return ApiSink(ctx, client, spill_path=spill)
    return NullSink(ctx)
