"""Checkpoints inside the ranks: snapshot, atomic write, then record or upload.

Only rank 0 writes (``make_checkpointer``). The training thread copies the state's tensors
into reused host buffers (``worker.runtime.checkpoints.snapshot``); one background thread
writes a temp file in the checkpoint directory and fsyncs it
(``worker.runtime.checkpoints.files``). Then, by the transport
(``worker.runtime.checkpoints.transport``):

- ``shared`` (the API sees this directory): it records the file through the attempt API
  (``POST /attempts/self/checkpoints``, fenced by the attempt token) and only then renames it
  into place, so a fenced-off attempt never replaces a file;
- ``upload``: it renames the file into place (this host's copy) and hands it to the uploader
  thread (``worker.runtime.checkpoints.uploader``), which streams it to the API; the service
  records it at the commit; the rank prunes the local copies the service no longer lists
  (``worker.runtime.checkpoints.upload_transport``).

A followed checkpoint (a command job's ``checkpoints.path``) goes the same way from its temp
file on (``Checkpointer.save_file``): the file the script wrote is copied on the caller's
thread (the script may overwrite it next), then recorded or uploaded with its ``file_name``.

Retention is the service's either way: at every record or commit it keeps the newest
``training.keep_checkpoints`` (and the checkpoint the current attempt resumed from), marks the
rest deleted and removes their bytes from its store.

Resume: ``worker.runtime.checkpoints.fetch``.

A write that fails (full disk, I/O error) publishes nothing and leaves the previous checkpoint
as it was: the temp file is removed, the failure is logged and recorded as a job event, and
training goes on; the next save tries again (what torchx/Determined users expect). Only when
the newest requested checkpoint (normally the final one) could not be written does ``close``
raise ``CheckpointWriteError``, so the end of training is not reported as a success without its
checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from service.core import artifacts
from service.core.errors import StaleAttemptError
from service.core.wire.attempt import AttemptSelf, CheckpointFailure, CheckpointRecord
from worker.attempt import STOP_UPLOAD_S
from worker.runtime.attempt_client import ApiUnavailableError, AttemptClient, AttemptRequestError
from worker.runtime.checkpoints.files import (
    CheckpointWriteError,
    FileVersion,
    VersionGoneError,
    describe_write_error,
    looks_torn,
    publish_checkpoint,
    write_temp_checkpoint,
    write_temp_copy,
)
from worker.runtime.checkpoints.reports import note_nothing_to_train
from worker.runtime.checkpoints.snapshot import Snapshot, SnapshotPool
from worker.runtime.checkpoints.transport import Transport, TransportChoice
from worker.runtime.checkpoints.upload_transport import UploadTransport
from worker.runtime.checkpoints.uploader import UploadItem
from worker.runtime.topology import RankEnv

log = logging.getLogger(__name__)

# The longest a checkpoint waits for the metric points reported before it (seconds): the
# writer stores them within a flush normally; longer means the API is out of reach, and the
# checkpoint's own recording would wait as long.
POINTS_WAIT_S = 30.0
# A checkpoint waiting for its points is given up once this many newer ones wait behind it
# (an API outage): bounds the recorder's queue and the temp files on disk.
MAX_NEWER_WAITING = 2


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint that is durable on disk and recorded through the attempt API."""

    step: int
    epoch: int
    path: Path
    size_bytes: int
    sha256: str


class PointsWatermark(Protocol):
    """The metric sink as a checkpointer sees it (``worker.runtime.metrics.buffer.Sink``)."""

    def handed(self) -> int: ...

    def wait_written(self, mark: int, timeout_s: float) -> bool: ...


class CheckpointSaver(Protocol):
    """What the training loop saves checkpoints through, on every rank.

    ``make_checkpointer`` builds the one for a rank: ``Checkpointer`` on rank 0, the null
    object ``NullCheckpointer`` elsewhere; the loop never asks which rank it is.
    """

    @property
    def last_saved(self) -> SavedCheckpoint | None:
        """The newest checkpoint this rank wrote and recorded; None when none (yet)."""
        ...

    def save(self, step: int, epoch: int, build_state: Callable[[], dict[str, Any]]) -> None:
        """Checkpoint ``build_state()`` at ``step``: the state is copied now, written later."""

    def save_file(
        self, step: int, epoch: int, source: Path, file_name: str,
        version: FileVersion | None = None,
    ) -> None:  # fmt: skip
        """Checkpoint the followed file ``source`` (its workspace-relative name
        ``file_name``; ``version`` of it, when given) at ``step``: copied now, recorded or
        uploaded later."""

    def should_stop(self) -> bool:
        """True when writes were fenced off (the attempt is stale)."""
        ...

    def wait(self) -> None:
        """Block until the write in flight is done."""

    def close(self) -> None:
        """Wait for the write in flight (and fail if the newest requested one failed)."""

    def note_nothing_to_train(self, step: int, total_steps: int) -> None:
        """Tell the job's events that an ``init_from`` start at ``step`` left nothing to
        train (``step`` ≥ ``total_steps``); rank 0 only."""


class NullCheckpointer:
    """The null ``CheckpointSaver`` (ranks other than 0): saving does nothing (and builds no
    state)."""

    last_saved: SavedCheckpoint | None = None

    def save(self, step: int, epoch: int, build_state: Callable[[], dict[str, Any]]) -> None:
        """Checkpoint ``build_state()`` at ``step`` (rank 0 only; no-op here)."""

    def save_file(
        self, step: int, epoch: int, source: Path, file_name: str,
        version: FileVersion | None = None,
    ) -> None:  # fmt: skip
        """Checkpoint the followed file ``source`` (rank 0 only; no-op here)."""

    def should_stop(self) -> bool:
        """True when writes were fenced off (the attempt is stale)."""
        return False

    def wait(self) -> None:
        """Block until the write in flight is done (nothing to wait for here)."""

    def close(self) -> None:
        """Wait for the write in flight."""

    def note_nothing_to_train(self, step: int, total_steps: int) -> None:
        """Rank 0 tells it (no-op here)."""


class Checkpointer(NullCheckpointer):
    """Rank 0's ``CheckpointSaver``: one background write at a time.

    Host memory: one copy of the state's tensors (the snapshot buffers), kept until ``close``.

    Args:
        client: the attempt API client (the checkpointer closes it in ``close``).
        keep: ``training.keep_checkpoints`` (the service applies it; kept for callers).
        transport: ``DDPQ_CHECKPOINT_TRANSPORT`` (``shared`` | ``upload`` | ``auto``, see
            ``worker.runtime.checkpoints.transport``). With ``upload`` the file is written and
            published locally, then a ``CheckpointUploader`` thread sends it; the service
            records it at the commit and owns retention (the rank prunes only its local copies).
        attempt_self: ``GET /attempts/self`` as the rank read it at start (``auto`` reads it
            at the first save when None).
        stop_upload_s: when ``stopping()`` is true at ``close`` (a signal), the longest wait
            for the stop checkpoint's upload (seconds), so the rank exits before its
            launcher's SIGKILL; otherwise the upload's own deadline bounds the wait.
        points: the rank's metric sink: a checkpoint is recorded (or uploaded) only once the
            points handed to it before the save are stored, at most ``POINTS_WAIT_S`` later
            (the next attempt resumes after the checkpoint's step: points still queued when
            the rank dies would never be written).
    """

    def __init__(
        self,
        client: AttemptClient,
        artifact_dir: Path,
        job_id: int,
        attempt: int,
        *,
        keep: int,
        transport: str = "shared",
        attempt_self: AttemptSelf | None = None,
        stopping: Callable[[], bool] = lambda: False,
        stop_upload_s: float = STOP_UPLOAD_S,
        points: PointsWatermark | None = None,
    ) -> None:
        self._client, self._artifact_dir = client, artifact_dir
        self._points = points
        self.job_id, self.attempt, self.keep = job_id, attempt, keep
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddpq-ckpt")
        self._future: Future[None] | None = None
        # Records (or uploads), in save order, once the points before each are stored: a
        # second thread, so the snapshot buffers are free as soon as the file is written and
        # the next save never waits on the points (an API outage holds them back).
        self._recorder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddpq-ckpt-rec")
        self._recorded: Future[None] | None = None
        self._waiting: list[int] = []  # steps written, handed to the recorder, not yet done
        self._stale = threading.Event()
        self._pool = SnapshotPool()
        self.last_step: int | None = None
        self.last_saved = None
        # Steps whose file could not be written (or uploaded), with the reason (newest last).
        self.failed: list[tuple[int, str]] = []
        self._transport = TransportChoice(client, artifact_dir, transport, attempt_self)
        self._uploads = UploadTransport(
            client, artifact_dir, job_id, attempt, on_committed=self._uploaded,
            on_failed=self._report_failure, on_stale=self._fenced,
            keep_step=lambda: self.last_step,
        )  # fmt: skip
        self._stopping, self._stop_upload_s = stopping, stop_upload_s

    def save(self, step: int, epoch: int, build_state: Callable[[], dict[str, Any]]) -> None:
        """Copy the state into the snapshot buffers now (training thread), write it in the
        background. Waits first if the previous write still reads those buffers. A second
        save of the same step is ignored."""
        if self._stale.is_set() or step == self.last_step:
            return
        self._wait_write()  # the writer must be done with the buffers before they are refilled
        snapshot = self._pool.snapshot(build_state())
        self.last_step = step
        mark = self._points.handed() if self._points is not None else 0
        self._future = self._executor.submit(self._write, step, epoch, snapshot, mark)

    def save_file(
        self, step: int, epoch: int, source: Path, file_name: str,
        version: FileVersion | None = None,
    ) -> None:  # fmt: skip
        """Checkpoint a followed file: copy ``source`` now, on the caller's thread (the script
        may overwrite it next), into the temp file of ``step``'s checkpoint while hashing it
        and fsync it; then record or upload it in the background as ``save`` does, with
        ``file_name`` (its workspace-relative name) on the record.

        A source that is not a regular file (a symbolic link) or changed during the copy is
        a failed save (logged, a job event, ``failed``), not an exception; one that vanished,
        is being written again, or is no longer ``version`` (a newer version is on its way,
        or came already: its own save takes it, under its own step) is skipped with a log
        line.
        A second save of the same step is ignored.
        """
        if self._stale.is_set() or step == self.last_step:
            return
        self.last_step = step
        path = artifacts.checkpoint_path(self._artifact_dir, self.job_id, step)
        try:
            tmp, size_bytes, sha256 = write_temp_copy(source, path, version)
        except VersionGoneError as exc:  # not a failure: a newer version (or none) follows
            log.info("followed file not taken at step %d: %s", step, exc)
            return
        except CheckpointWriteError as exc:
            self._report_failure(step, str(exc))
            return
        if looks_torn(tmp):  # a torch.save cut short (a crash): never a checkpoint
            tmp.unlink(missing_ok=True)
            log.warning("%s is a zip archive cut short (a save the script did not finish): "
                        "not taken", source)  # fmt: skip
            return
        self.wait()
        written = UploadItem(step, epoch, path, size_bytes, sha256, file_name)
        self._future = self._executor.submit(self._keep, written, tmp)

    def should_stop(self) -> bool:
        return self._stale.is_set()

    def close(self) -> None:
        """Wait for the write in flight and, with the upload transport, for its upload (bounded
        by the upload's deadline, or ``stop_upload_s`` when stopping); free the buffers.

        Raises:
            CheckpointWriteError: the newest checkpoint asked for (normally the final one)
                could not be written or uploaded; earlier failures were only warnings.
        """
        try:
            self.wait()
            self._uploads.close(
                stopping=self._stopping(),
                stop_upload_s=self._stop_upload_s,
                step=self.last_step if self.last_step is not None else 0,
            )
        finally:
            self._executor.shutdown(wait=True)
            self._recorder.shutdown(wait=True)
            self._pool.release()
            self._client.close()
        # Two threads note failures (the writer's and the recorder's), not always in save
        # order: the newest step's failure is looked for, not the last noted.
        newest = [reason for step, reason in self.failed if step == self.last_step]
        if newest and not self._stale.is_set():
            raise CheckpointWriteError(
                f"checkpoint at step {self.last_step} could not be written: {newest[-1]}"
            )

    def wait_uploaded(self, timeout_s: float | None = None) -> bool:
        """Block until the write in flight and every upload are done (or ``timeout_s``
        seconds); True when nothing is left. Not for the training loop: it never waits."""
        self.wait()
        return self._uploads.wait_idle(timeout_s)

    def wait(self) -> None:
        """Block until the write in flight (if any) is durable and recorded, or has failed."""
        self._wait_write()
        if self._recorded is not None:
            self._recorded.result()
            self._recorded = None

    def _wait_write(self) -> None:
        """Block until the write in flight (if any) is durable: its buffers are free."""
        if self._future is not None:
            self._future.result()
            self._future = None

    def _write(self, step: int, epoch: int, snapshot: Snapshot, mark: int) -> None:
        path = artifacts.checkpoint_path(self._artifact_dir, self.job_id, step)
        snapshot.wait()
        try:
            tmp, size_bytes, sha256 = write_temp_checkpoint(snapshot.state, path)
        except CheckpointWriteError as exc:
            self._report_failure(step, str(exc))
            return
        written = UploadItem(step, epoch, path, size_bytes, sha256)
        if self._points is None:
            self._keep(written, tmp)
        else:
            self._waiting.append(step)
            try:
                self._recorded = self._recorder.submit(self._keep_after_points, written, tmp, mark)
            except RuntimeError:  # the interpreter is exiting (a save in an atexit hook)
                self._keep_after_points(written, tmp, mark)

    def _keep_after_points(self, written: UploadItem, tmp: Path, mark: int) -> None:
        """``_keep`` once the sink stored the ``mark`` points handed before the save. A
        checkpoint with ``MAX_NEWER_WAITING`` newer ones written behind it while it waited is
        skipped (its temp file removed): during an API outage only the newest few wait, so
        the queue and the disk hold a bounded number of them, while a recorder that is merely
        slow (a loaded box, a slow API) still keeps every checkpoint."""
        assert self._points is not None
        try:
            newer = [s for s in list(self._waiting) if s > written.step]
            if len(newer) >= MAX_NEWER_WAITING:
                tmp.unlink(missing_ok=True)
                log.info("checkpoint step=%d skipped: steps %s were written meanwhile",
                         written.step, newer)  # fmt: skip
                return
            if not self._points.wait_written(mark, POINTS_WAIT_S):
                log.warning("metric points before step %d not all stored after %.0f s; "
                            "checkpointing anyway", written.step, POINTS_WAIT_S)  # fmt: skip
            self._keep(written, tmp)
        finally:
            self._waiting.remove(written.step)

    def _keep(self, written: UploadItem, tmp: Path) -> None:
        """The written temp file ``tmp`` (durable, hashed) becomes the checkpoint ``written``:
        recorded, then renamed into place (shared); or renamed, then uploaded (upload)."""
        step, epoch, path = written.step, written.epoch, written.path
        size_bytes, sha256 = written.size_bytes, written.sha256
        if self._transport.resolved() == "upload":
            self._uploads.publish_and_upload(written, tmp)
            return
        record = CheckpointRecord(
            step=step, epoch=epoch, path=str(path), size_bytes=size_bytes, sha256=sha256,
            staged_path=str(tmp), file_name=written.file_name,
        )  # fmt: skip
        try:
            # Recorded first, published after: the fence decides before a file is replaced.
            self._client.record_checkpoint(record)
            try:
                publish_checkpoint(tmp, path)
            except OSError as exc:  # the rename or the directory fsync
                self._report_failure(step, describe_write_error(exc))
                self._forget([step])  # recorded, but its file is not in place
                return
        except StaleAttemptError as exc:
            log.warning("checkpoint at step %d fenced off, stopping: %s", step, exc)
            self._stale.set()
            return
        except AttemptRequestError as exc:
            # Refused (the server could not verify the file): a failed save, which the server
            # already noted as a job event; the final save's failure fails the job at close.
            self.failed.append((step, f"not recorded: {exc}"))
            log.error("checkpoint at step %d not recorded: %s", step, exc)
            return
        except ApiUnavailableError as exc:
            log.error("checkpoint at step %d not recorded: %s", step, exc)
            self._report_failure(step, f"not recorded: {exc}")
            return
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        self.last_saved = SavedCheckpoint(step, epoch, path, size_bytes, sha256)
        log.info("checkpoint step=%d written (%d bytes) to %s", step, size_bytes, path)

    @property
    def transport(self) -> Transport | None:
        """``shared`` or ``upload`` once decided (at start, or at the first save); None before."""
        return self._transport.transport

    def note_nothing_to_train(self, step: int, total_steps: int) -> None:
        """Tell the job's events (best effort) that an ``init_from`` start left nothing to
        train."""
        note_nothing_to_train(self._client, step, total_steps)

    def _uploaded(self, item: UploadItem) -> None:
        self.last_saved = SavedCheckpoint(
            item.step, item.epoch, item.path, item.size_bytes, item.sha256
        )

    def _fenced(self, reason: str) -> None:
        log.warning("checkpoint upload fenced off, stopping: %s", reason)
        self._stale.set()

    def _report_failure(self, step: int, reason: str) -> None:
        """Log it, note it as a job event, keep training (the next save tries again)."""
        self.failed.append((step, reason))
        log.error(
            "checkpoint at step %d could not be written; the previous one is intact and the "
            "next save retries: %s",
            step,
            reason,
        )
        try:
            self._client.record_checkpoint_failure(CheckpointFailure(step=step, reason=reason))
        except StaleAttemptError as exc:
            log.warning("checkpoint failure at step %d not recorded, stopping: %s", step, exc)
            self._stale.set()
        except (ApiUnavailableError, AttemptRequestError) as exc:
            log.warning("checkpoint failure at step %d not recorded: %s", step, exc)

    def _forget(self, steps: list[int]) -> None:
        """Record ``steps`` as deleted (best effort: resume verifies every file anyway)."""
        try:
            self._client.record_deletions(steps, damaged=False)
        except StaleAttemptError as exc:
            log.warning("checkpoint deletion not recorded, stopping: %s", exc)
            self._stale.set()
        except (ApiUnavailableError, AttemptRequestError) as exc:
            log.warning("checkpoint deletion of steps %s not recorded: %s", steps, exc)


def make_checkpointer(
    env: RankEnv,
    artifact_dir: Path,
    *,
    keep: int,
    transport: str = "auto",
    attempt_self: AttemptSelf | None = None,
    stopping: Callable[[], bool] = lambda: False,
    points: PointsWatermark | None = None,
) -> CheckpointSaver:
    """The one place that decides who writes checkpoints: a Checkpointer on rank 0 (with its
    own ``AttemptClient`` for ``env``), else the null object NullCheckpointer. ``transport``,
    ``attempt_self``, ``stopping`` and ``points``: see ``Checkpointer``."""
    if env.rank == 0:
        client = AttemptClient(env.api_url, env.attempt_token)
        return Checkpointer(
            client, artifact_dir, env.job_id, env.attempt, keep=keep, transport=transport,
            attempt_self=attempt_self, stopping=stopping, points=points,
        )  # fmt: skip
    return NullCheckpointer()
