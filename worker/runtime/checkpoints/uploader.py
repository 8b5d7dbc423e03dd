"""Rank 0's checkpoint uploader: sends checkpoint files it wrote locally to the attempt API
when the API's host does not share the rank's filesystem (``DDPQ_CHECKPOINT_TRANSPORT``).

One daemon thread, never the training thread: ``submit`` only swaps a reference. The file is
read ``chunk_bytes`` at a time (the server's ``UploadStatus.chunk_bytes``, 16 MiB by default),
never whole; each chunk carries its sha256 (``CHUNK_SHA256_HEADER``); after any error the
upload goes on from the server's ``received_bytes`` (``GET`` the upload's status), after a
backoff that honours ``Retry-After``. The service writes the checkpoint row only at the
commit, once the whole file's sha256 matches: that row is the only "latest" pointer.

Only the newest checkpoint needs to go: a checkpoint submitted while another still waits
replaces it (the older one is never sent). The one in flight finishes, unless the uploader is
closing and a newer one waits (the stop checkpoint matters more).

Every upload has a deadline: ``max(UPLOAD_FLOOR_S, size / bandwidth × UPLOAD_SAFETY)``, with
the bandwidth the last upload measured (``ASSUMED_BYTES_PER_S`` before the first). Past it the
save fails (``on_failed(step, reason)``, recorded as a job event by the checkpointer) and
training goes on: an upload can be slow, never hang.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol, TypeVar

from service.core.errors import DdpqError, StaleAttemptError
from service.core.wire import attempt as wire
from service.core.wire.chunks import MAX_CHUNK_REFUSALS, send_file_chunks
from worker.runtime.attempt_client import (
    ApiUnavailableError,
    AttemptRequestError,
    UploadOffsetError,
)

log = logging.getLogger(__name__)
_T = TypeVar("_T")

# A deadline is never shorter than this (seconds): request latency dominates small files.
UPLOAD_FLOOR_S = 60.0
# Deadline = size / measured bandwidth × this: room for a slower link than last time.
UPLOAD_SAFETY = 4.0
# Bandwidth assumed before the first upload measured one (bytes/s, ~100 Mbit/s).
ASSUMED_BYTES_PER_S = 12.5e6
# Backoff between retries after an error (seconds): doubles from MIN to MAX.
RETRY_MIN_S, RETRY_MAX_S = 0.25, 10.0
# The uploader thread's nice value (Linux: per thread): with the CPU contended, the training
# thread and the data loaders go first; the upload takes what is left (its deadline allows).
UPLOADER_NICE = 10


@dataclass(frozen=True)
class UploadItem:
    """A checkpoint file on this host, durable and complete, to send (``file_name``: the
    workspace file a followed checkpoint is a version of; None for ddpq's own)."""

    step: int
    epoch: int
    path: Path
    size_bytes: int
    sha256: str
    file_name: str | None = None


class UploadFailedError(DdpqError):
    """An upload ran past its deadline, or the service refused it (the reason says which)."""

    status_code = 502
    code = "checkpoint_upload_failed"


class UploadClient(Protocol):
    """What the uploader needs of ``AttemptClient`` (tests pass the real one over a fake API)."""

    def begin_upload(self, start: wire.UploadStart) -> wire.UploadStatus: ...
    def upload_status(self, upload_id: int) -> wire.UploadStatus: ...
    def send_chunk(self, upload_id: int, offset: int, data: bytes) -> wire.UploadStatus: ...
    def commit_upload(self, upload_id: int) -> wire.CheckpointEntry: ...


def upload_deadline_s(size_bytes: int, bytes_per_s: float) -> float:
    """Seconds one upload of ``size_bytes`` may take at a measured ``bytes_per_s``."""
    return max(UPLOAD_FLOOR_S, size_bytes / max(bytes_per_s, 1.0) * UPLOAD_SAFETY)


class _Superseded(Exception):
    """The upload in flight gave way to a newer checkpoint (only while closing), or was
    abandoned."""


class CheckpointUploader:
    """One background thread that uploads the newest submitted checkpoint.

    Args:
        client: the attempt API client (thread-safe; shared with the checkpointer).
        on_committed: called in the uploader's thread with each committed item.
        on_failed: called with ``(step, reason)`` when an upload failed or timed out.
        on_stale: called with the reason when the attempt was fenced off (nothing more goes).
    """

    def __init__(
        self,
        client: UploadClient,
        *,
        on_committed: Callable[[UploadItem], None],
        on_failed: Callable[[int, str], None],
        on_stale: Callable[[str], None],
    ) -> None:
        self._client = client
        self._on_committed, self._on_failed, self._on_stale = on_committed, on_failed, on_stale
        self._cond = threading.Condition()
        self._waiting: UploadItem | None = None
        self._current: UploadItem | None = None
        self._closing = False
        self._stopped = False
        self._abandoned = False
        self.bytes_per_s = ASSUMED_BYTES_PER_S
        self.deadline_mono: float | None = None  # of the upload in flight
        self._thread = threading.Thread(target=self._run, name="ddpq-ckpt-upload", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether an upload is in flight or waiting."""
        with self._cond:
            return self._current is not None or self._waiting is not None

    def submit(self, item: UploadItem) -> UploadItem | None:
        """Queue ``item`` for upload (returns at once). Returns the waiting item it replaced
        (never sent), or None."""
        with self._cond:
            replaced, self._waiting = self._waiting, item
            self._cond.notify_all()
        if replaced is not None:
            log.info("checkpoint step=%d superseded by step=%d before its upload",
                     replaced.step, item.step)  # fmt: skip
        return replaced

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until nothing is in flight or waiting (or ``timeout_s``); True when idle."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._current is not None or self._waiting is not None:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 1.0)
        return True

    def close(self, timeout_s: float | None = None) -> None:
        """Upload what is waiting (a newer waiting checkpoint preempts the one in flight),
        then stop the thread. Bounded by the uploads' deadlines, or by ``timeout_s`` (after
        ``abandon``: a request in flight is left to its own timeout in the daemon thread).
        Idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def abandon(self) -> None:
        """Give up what waits and what is in flight (at its next chunk or retry), without
        reporting it (the caller does): for a rank that must exit now."""
        with self._cond:
            self._abandoned = True
            self._waiting = None
            self._cond.notify_all()

    def deadline_for(self, item: UploadItem) -> float:
        """Seconds ``item``'s upload may take (``upload_deadline_s`` at the measured rate)."""
        return upload_deadline_s(item.size_bytes, self.bytes_per_s)

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        if sys.platform.startswith("linux"):  # a thread id names one thread only there
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), UPLOADER_NICE)
        while True:
            with self._cond:
                while self._waiting is None and not self._closing and not self._stopped:
                    self._cond.wait()
                if self._waiting is None or self._stopped:
                    self._current = self._waiting = None
                    self._cond.notify_all()
                    return
                self._current, self._waiting = self._waiting, None
            item = self._current
            try:
                self._upload(item)
            except _Superseded:
                log.info("upload of checkpoint step=%d given up for a newer one", item.step)
            except StaleAttemptError as exc:
                self._stopped = True
                self._on_stale(str(exc))
            except UploadFailedError as exc:
                self._on_failed(item.step, str(exc))
            except Exception as exc:  # an unreadable file, a bug: the save fails, training goes on
                log.exception("upload of checkpoint step=%d failed", item.step)
                self._on_failed(item.step, f"upload failed: {type(exc).__name__}: {exc}")
            finally:
                with self._cond:
                    self._current = None
                    self.deadline_mono = None
                    self._cond.notify_all()

    def _upload(self, item: UploadItem) -> None:
        started = time.monotonic()
        deadline_s = self.deadline_for(item)
        self.deadline_mono = started + deadline_s
        start = wire.UploadStart(
            step=item.step, epoch=item.epoch, size_bytes=item.size_bytes, sha256=item.sha256,
            file_name=item.file_name,
        )  # fmt: skip
        status = self._retrying(item, lambda: self._client.begin_upload(start))
        sent = 0
        with open(item.path, "rb") as fh:
            while True:
                status, n = self._send_rest(item, fh, status)
                sent += n
                if status.state == "abandoned":
                    raise UploadFailedError(
                        f"upload of checkpoint at step {item.step} was abandoned by the "
                        "service (a newer checkpoint's upload began)"
                    )
                if status.state == "committed":
                    break
                try:
                    commit = functools.partial(self._client.commit_upload, status.upload_id)
                    self._retrying(item, commit)
                    break
                except UploadOffsetError as exc:  # bytes went missing (an API restart): resend
                    status = exc.status
        elapsed = time.monotonic() - started
        if sent >= 4 * 2**20 and elapsed > 0:
            self.bytes_per_s = sent / elapsed
        log.info("checkpoint step=%d uploaded (%d bytes in %.1f s)", item.step, sent, elapsed)
        self._on_committed(item)

    def _send_rest(
        self, item: UploadItem, fh: BinaryIO, status: wire.UploadStatus
    ) -> tuple[wire.UploadStatus, int]:
        """Send chunks from the server's ``received_bytes`` to the end; returns the last status
        and the bytes sent. A damaged chunk (422) is sent again, ``MAX_CHUNK_REFUSALS`` times
        in a row at most; after an outage the server's status says where to go on."""
        refusals = 0

        def accepted(_n: int) -> None:
            nonlocal refusals
            refusals = 0

        def recover(exc: Exception, status: wire.UploadStatus) -> wire.UploadStatus:
            nonlocal refusals
            if isinstance(exc, UploadOffsetError):
                return exc.status  # the server holds another offset: go on from there
            if isinstance(exc, AttemptRequestError):  # the chunk arrived damaged: send it again
                refusals += 1
                log.warning("chunk at byte %d of step=%d refused (%d in a row): %s",
                            status.received_bytes, item.step, refusals, exc)  # fmt: skip
                if refusals >= MAX_CHUNK_REFUSALS:
                    raise UploadFailedError(
                        f"upload of checkpoint at step {item.step}: {refusals} chunks in a row "
                        f"refused: {exc}"
                    ) from None
                return status
            if isinstance(exc, ApiUnavailableError):
                self._back_off(item, exc, 0)
                return self._retrying(
                    item, functools.partial(self._client.upload_status, status.upload_id)
                )
            raise exc

        return send_file_chunks(
            fh,
            status,
            item.size_bytes,
            self._client.send_chunk,
            recover,
            before_chunk=functools.partial(self._check, item),
            on_accepted=accepted,
        )

    def _check(self, item: UploadItem) -> None:
        """Raise when the upload is past its deadline, or must give way while closing."""
        if self.deadline_mono is not None and time.monotonic() > self.deadline_mono:
            raise UploadFailedError(
                f"upload of checkpoint at step {item.step} ({item.size_bytes} bytes) did not "
                f"finish within its deadline of {self.deadline_for(item):.0f} s"
            )
        with self._cond:
            if self._abandoned or (self._closing and self._waiting is not None):
                raise _Superseded()

    def _back_off(self, item: UploadItem, exc: ApiUnavailableError, tries: int) -> None:
        wait_s = max(min(RETRY_MIN_S * 2**tries, RETRY_MAX_S), exc.retry_after_s or 0.0)
        if self.deadline_mono is not None:
            wait_s = min(wait_s, max(self.deadline_mono - time.monotonic(), 0.0))
        log.warning("upload of step=%d: API unavailable, retrying in %.1f s: %s",
                    item.step, wait_s, exc)  # fmt: skip
        time.sleep(wait_s)
        self._check(item)

    def _retrying(self, item: UploadItem, call: Callable[[], _T]) -> _T:
        """``call()`` until it answers, backing off while the API is unavailable, until the
        deadline. A refusal (422) fails the upload; the fence propagates."""
        tries = 0
        while True:
            self._check(item)
            try:
                return call()
            except ApiUnavailableError as exc:
                self._back_off(item, exc, tries)
                tries += 1
            except AttemptRequestError as exc:
                raise UploadFailedError(
                    f"upload of checkpoint at step {item.step} refused: {exc}"
                ) from None
