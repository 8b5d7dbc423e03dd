"""Checkpoints inside the ranks: snapshot, atomic write, sha256, record, rotation; and resume.

Only rank 0 writes (``make_checkpointer``). The training thread copies the state's tensors
into reused host buffers (``worker.runtime.snapshot``); one background thread writes a temp
file in the checkpoint directory, fsyncs it, records it through the attempt API
(``POST /attempts/self/checkpoints``, fenced by the attempt token) and only then renames it
into place, so a fenced-off attempt never replaces a file; then it rotates old checkpoints
away (recording their deletion). Resume reads the job's checkpoint list from the API and
verifies each file (size and sha256) in the shared artifact directory.

A write that fails (full disk, I/O error) publishes nothing and leaves the previous checkpoint
as it was: the temp file is removed, the failure is logged and recorded as a job event, and
training goes on; the next save tries again (what torchx/Determined users expect). Only when
the newest requested checkpoint (normally the final one) could not be written does ``close``
raise ``CheckpointWriteError``, so the end of training is not reported as a success without its
checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from service.core import artifacts
from service.core.attempt_api import CheckpointEntry, CheckpointFailure, CheckpointRecord
from service.core.errors import DdpqError, NotFoundError, StaleAttemptError
from worker.runtime.attempt_client import ApiUnavailableError, AttemptClient, AttemptRequestError
from worker.runtime.distributed import DistContext, broadcast_int
from worker.runtime.snapshot import Snapshot, SnapshotPool
from worker.runtime.topology import RankEnv

log = logging.getLogger(__name__)
_READ_CHUNK_BYTES = 1 << 20
# How long rank 0 keeps asking for the checkpoint list at resume while the API is down
# (seconds); the other ranks wait in the broadcast meanwhile (well under the pg timeout).
RESUME_LIST_WAIT_S = 120.0


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint that is durable on disk and recorded through the attempt API."""

    step: int
    epoch: int
    path: Path
    size_bytes: int
    sha256: str


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_READ_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointWriteError(DdpqError):
    """A checkpoint file could not be written (full disk, I/O error, unpicklable state)."""

    status_code = 500
    code = "checkpoint_write_failed"


def describe_write_error(exc: BaseException) -> str:
    """A one-line reason for a failed write, naming the OS error when there is one.

    ``torch.save`` reports a failed ``write`` as a bare RuntimeError ("unexpected pos …") with
    the real ``OSError`` (e.g. ENOSPC) only as its ``__context__``; this digs it out.
    """
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return f"{type(seen).__name__}: {seen}"
        seen = seen.__cause__ or seen.__context__
    return f"{type(exc).__name__}: {exc}"


def write_temp_checkpoint(state: dict[str, Any], final_path: Path) -> tuple[Path, int, str]:
    """``torch.save`` ``state`` to a temp file next to ``final_path`` and fsync it.

    Returns:
        ``(temp_path, size_bytes, sha256)``; rename it to ``final_path`` to publish it.
    Raises:
        CheckpointWriteError: the write failed (e.g. ``ENOSPC``); no temp file is left.
    """
    tmp = final_path.with_name(f".{final_path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        final_path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        return tmp, tmp.stat().st_size, file_sha256(tmp)
    except Exception as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise CheckpointWriteError(describe_write_error(exc)) from exc


def publish_checkpoint(tmp: Path, final_path: Path) -> None:
    """Atomically rename the temp file into place and make the rename durable."""
    os.replace(tmp, final_path)
    _fsync_dir(final_path.parent)


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

    def should_stop(self) -> bool:
        """True when writes were fenced off (the attempt is stale)."""
        ...

    def wait(self) -> None:
        """Block until the write in flight is done."""

    def close(self) -> None:
        """Wait for the write in flight (and fail if the newest requested one failed)."""


class NullCheckpointer:
    """The null ``CheckpointSaver`` (ranks other than 0): saving does nothing (and builds no
    state)."""

    last_saved: SavedCheckpoint | None = None

    def save(self, step: int, epoch: int, build_state: Callable[[], dict[str, Any]]) -> None:
        """Checkpoint ``build_state()`` at ``step`` (rank 0 only; no-op here)."""

    def should_stop(self) -> bool:
        """True when writes were fenced off (the attempt is stale)."""
        return False

    def wait(self) -> None:
        """Block until the write in flight is done (nothing to wait for here)."""

    def close(self) -> None:
        """Wait for the write in flight."""


class Checkpointer(NullCheckpointer):
    """Rank 0's ``CheckpointSaver``: one background write at a time, newest ``keep`` kept.

    Host memory: one copy of the state's tensors (the snapshot buffers), kept until ``close``.

    Args:
        client: the attempt API client (the checkpointer closes it in ``close``).
        keep: the newest checkpoints kept; older ones are deleted after each save.
    """

    def __init__(
        self, client: AttemptClient, artifact_dir: Path, job_id: int, attempt: int, *, keep: int
    ) -> None:
        self._client, self._artifact_dir = client, artifact_dir
        self.job_id, self.attempt, self.keep = job_id, attempt, keep
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddpq-ckpt")
        self._future: Future[None] | None = None
        self._stale = threading.Event()
        self._pool = SnapshotPool()
        self.last_step: int | None = None
        self.last_saved = None
        # Steps whose file could not be written, with the reason (newest last).
        self.failed: list[tuple[int, str]] = []

    def save(self, step: int, epoch: int, build_state: Callable[[], dict[str, Any]]) -> None:
        """Copy the state into the snapshot buffers now (training thread), write it in the
        background. Waits first if the previous write still reads those buffers. A second
        save of the same step is ignored."""
        if self._stale.is_set() or step == self.last_step:
            return
        self.wait()  # the writer must be done with the buffers before they are refilled
        snapshot = self._pool.snapshot(build_state())
        self.last_step = step
        self._future = self._executor.submit(self._write, step, epoch, snapshot)

    def should_stop(self) -> bool:
        return self._stale.is_set()

    def close(self) -> None:
        """Wait for the write in flight and free the snapshot buffers.

        Raises:
            CheckpointWriteError: the newest checkpoint asked for (normally the final one)
                could not be written; earlier failures were only warnings.
        """
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self._pool.release()
            self._client.close()
        if self.failed and self.failed[-1][0] == self.last_step and not self._stale.is_set():
            step, reason = self.failed[-1]
            raise CheckpointWriteError(f"checkpoint at step {step} could not be written: {reason}")

    def wait(self) -> None:
        """Block until the write in flight (if any) is durable and recorded, or has failed."""
        if self._future is not None:
            self._future.result()
            self._future = None

    def _write(self, step: int, epoch: int, snapshot: Snapshot) -> None:
        path = artifacts.checkpoint_path(self._artifact_dir, self.job_id, step)
        snapshot.wait()
        try:
            tmp, size_bytes, sha256 = write_temp_checkpoint(snapshot.state, path)
        except CheckpointWriteError as exc:
            self._report_failure(step, str(exc))
            return
        record = CheckpointRecord(
            step=step, epoch=epoch, path=str(path), size_bytes=size_bytes, sha256=sha256
        )
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
        except (ApiUnavailableError, AttemptRequestError) as exc:
            log.error("checkpoint at step %d not recorded: %s", step, exc)
            return
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        self.last_saved = SavedCheckpoint(step, epoch, path, size_bytes, sha256)
        log.info("checkpoint step=%d written (%d bytes) to %s", step, size_bytes, path)
        self._rotate()

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
            self._client.record_deletions(steps)
        except StaleAttemptError as exc:
            log.warning("checkpoint deletion not recorded, stopping: %s", exc)
            self._stale.set()
        except (ApiUnavailableError, AttemptRequestError) as exc:
            log.warning("checkpoint deletion of steps %s not recorded: %s", steps, exc)

    def _rotate(self) -> None:
        """Delete the checkpoints past the newest ``keep``: the record first (so resume never
        picks a file about to vanish), then the file."""
        try:
            old = self._client.list_checkpoints()[self.keep :]
            if old:
                self._client.record_deletions([c.step for c in old])
        except StaleAttemptError as exc:
            log.warning("checkpoint rotation fenced off, stopping: %s", exc)
            self._stale.set()
            return
        except (ApiUnavailableError, AttemptRequestError) as exc:
            log.warning("checkpoint rotation skipped: %s", exc)
            return
        for entry in old:
            with contextlib.suppress(NotFoundError, FileNotFoundError):
                artifacts.confine(self._artifact_dir, entry.path).unlink()


def make_checkpointer(env: RankEnv, artifact_dir: Path, *, keep: int) -> CheckpointSaver:
    """The one place that decides who writes checkpoints: a Checkpointer on rank 0 (with its
    own ``AttemptClient`` for ``env``), else the null object NullCheckpointer."""
    if env.rank == 0:
        client = AttemptClient(env.api_url, env.attempt_token)
        return Checkpointer(client, artifact_dir, env.job_id, env.attempt, keep=keep)
    return NullCheckpointer()


def _list_checkpoints(client: AttemptClient) -> list[CheckpointEntry]:
    """The job's checkpoint list, retried with backoff (and ``Retry-After``) for up to
    ``RESUME_LIST_WAIT_S`` while the API is unavailable: a rank may start during an outage."""
    deadline_s = time.monotonic() + RESUME_LIST_WAIT_S
    delay_s = 0.25
    while True:
        try:
            return client.list_checkpoints()
        except ApiUnavailableError as exc:
            wait_s = max(delay_s, exc.retry_after_s or 0.0)
            if time.monotonic() + wait_s > deadline_s:
                raise
            log.warning("checkpoint list unavailable, retrying in %.1f s: %s", wait_s, exc)
            time.sleep(wait_s)
            delay_s = min(delay_s * 2, 5.0)


def find_resume_checkpoint(client: AttemptClient, artifact_dir: Path, job_id: int) -> int | None:
    """The step of the newest recorded checkpoint whose file exists with the recorded size and
    sha256 (the list from ``GET /attempts/self/checkpoints``). Corrupt or missing ones are
    logged and recorded deleted so rotation ignores them (best effort).

    Returns:
        The step, or None when there is nothing to resume from.
    Raises:
        StaleAttemptError: the attempt is fenced off.
        ApiUnavailableError: the list could not be read within ``RESUME_LIST_WAIT_S``
            (starting from nothing instead would redo finished steps: the rank fails).
    """
    candidates = [(c.step, c.size_bytes, c.sha256) for c in _list_checkpoints(client)]
    bad: list[int] = []
    chosen: int | None = None
    for step, size_bytes, sha256 in candidates:
        path = artifacts.checkpoint_path(artifact_dir, job_id, step)
        if not path.is_file():
            log.warning("checkpoint step=%d missing at %s; skipped", step, path)
        elif path.stat().st_size != size_bytes or file_sha256(path) != sha256:
            log.warning("checkpoint step=%d at %s fails its sha256; skipped", step, path)
        else:
            chosen = step
            break
        bad.append(step)
    if bad:
        try:
            client.record_deletions(bad)
        except (ApiUnavailableError, AttemptRequestError) as exc:
            log.warning("damaged checkpoints %s not recorded deleted: %s", bad, exc)
    return chosen


def agree_on_resume_step(
    ctx: DistContext, client: AttemptClient | None, artifact_dir: Path, job_id: int
) -> int:
    """Rank 0 picks the checkpoint to resume from and broadcasts its step; every rank returns
    the same step (0: start from scratch). A collective: all ranks must call it.

    Args:
        client: rank 0's attempt API client (other ranks may pass None).
    Raises:
        ValueError: rank 0 without a client.
    """
    step = 0
    if ctx.rank == 0:
        if client is None:
            raise ValueError("rank 0 needs an AttemptClient to find its resume checkpoint")
        step = find_resume_checkpoint(client, artifact_dir, job_id) or 0
    return broadcast_int(step, ctx)


def agree_on_resume(
    ctx: DistContext, client: AttemptClient | None, artifact_dir: Path, job_id: int
) -> Path | None:
    """``agree_on_resume_step`` as the checkpoint's path (None: start from scratch)."""
    step = agree_on_resume_step(ctx, client, artifact_dir, job_id)
    return artifacts.checkpoint_path(artifact_dir, job_id, step) if step > 0 else None


def load_checkpoint_file(path: Path, device: torch.device) -> dict[str, Any]:
    """Load one of our own checkpoint files onto ``device`` (weights_only=False: it holds RNG
    states and optimizer state written by ddpq itself)."""
    state = torch.load(path, map_location=device, weights_only=False)
    if not isinstance(state, dict):
        raise ValueError(f"{path} does not hold a checkpoint dict")
    return state
