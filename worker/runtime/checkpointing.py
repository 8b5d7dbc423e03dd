"""Checkpoints inside the ranks: snapshot, atomic write, sha256, record, rotation; and resume.

Only rank 0 writes (``make_checkpointer``). The training thread snapshots tensors to CPU copies;
one background thread writes a temp file in the checkpoint directory, fsyncs it, records it
with ``service.checkpoints.record_checkpoint`` (fenced by attempt) and renames it into place
inside that transaction, then rotates old checkpoints away.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from service import artifacts
from service.checkpoints import list_checkpoints, mark_checkpoints_deleted, record_checkpoint
from service.db import Database
from service.errors import DatabaseUnavailableError, NotFoundError, StaleAttemptError
from worker.runtime.distributed import DistContext, broadcast_int

log = logging.getLogger(__name__)
_READ_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint that is durable on disk and recorded in the database."""

    step: int
    epoch: int
    path: Path
    size_bytes: int
    sha256: str


def snapshot_to_cpu(obj: Any) -> Any:
    """A deep copy of ``obj`` with every tensor copied to CPU (detached), so training can go
    on mutating its parameters while the copy is written."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [snapshot_to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(snapshot_to_cpu(v) for v in obj)
    return copy.deepcopy(obj)


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


def write_temp_checkpoint(state: dict[str, Any], final_path: Path) -> tuple[Path, int, str]:
    """``torch.save`` ``state`` to a temp file next to ``final_path`` and fsync it.

    Returns:
        ``(temp_path, size_bytes, sha256)``; rename it to ``final_path`` to publish it.
    """
    final_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = final_path.with_name(f".{final_path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    return tmp, tmp.stat().st_size, file_sha256(tmp)


def publish_checkpoint(tmp: Path, final_path: Path) -> None:
    """Atomically rename the temp file into place and make the rename durable."""
    os.replace(tmp, final_path)
    _fsync_dir(final_path.parent)


class NullCheckpointer:
    """Ranks other than 0: saving does nothing (and builds no state)."""

    last_saved: SavedCheckpoint | None = None

    def save(self, step: int, epoch: int, build_state: Callable[[], dict[str, Any]]) -> None:
        """Checkpoint ``build_state()`` at ``step`` (rank 0 only; no-op here)."""

    def should_stop(self) -> bool:
        """True when writes were fenced off (the attempt is stale)."""
        return False

    def close(self) -> None:
        """Wait for the write in flight."""


class Checkpointer(NullCheckpointer):
    """Rank 0's checkpoint writer: one background write at a time, newest ``keep`` kept."""

    def __init__(
        self, db: Database, artifact_dir: Path, job_id: int, attempt: int, *, keep: int
    ) -> None:
        self._db, self._artifact_dir = db, artifact_dir
        self.job_id, self.attempt, self.keep = job_id, attempt, keep
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddpq-ckpt")
        self._future: Future[None] | None = None
        self._stale = threading.Event()
        self.last_step: int | None = None
        self.last_saved = None

    def save(self, step: int, epoch: int, build_state: Callable[[], dict[str, Any]]) -> None:
        """Snapshot now (training thread), write in the background. Waits only if the previous
        write is still running. A second save of the same step is ignored."""
        if self._stale.is_set() or step == self.last_step:
            return
        state = snapshot_to_cpu(build_state())
        self._wait()
        self.last_step = step
        self._future = self._executor.submit(self._write, step, epoch, state)

    def should_stop(self) -> bool:
        return self._stale.is_set()

    def close(self) -> None:
        self._wait()
        self._executor.shutdown(wait=True)

    def _wait(self) -> None:
        if self._future is not None:
            self._future.result()
            self._future = None

    def _write(self, step: int, epoch: int, state: dict[str, Any]) -> None:
        path = artifacts.checkpoint_path(self._artifact_dir, self.job_id, step)
        tmp, size_bytes, sha256 = write_temp_checkpoint(state, path)
        try:
            with self._db.session() as session:
                record_checkpoint(
                    session,
                    self.job_id,
                    self.attempt,
                    step=step,
                    epoch=epoch,
                    path=str(path),
                    size_bytes=size_bytes,
                    sha256=sha256,
                )
                # Inside the fenced transaction: a stale attempt never replaces a file.
                publish_checkpoint(tmp, path)
        except (StaleAttemptError, NotFoundError) as exc:
            log.warning("checkpoint at step %d fenced off, stopping: %s", step, exc)
            self._stale.set()
            return
        except DatabaseUnavailableError as exc:
            log.error("checkpoint at step %d not recorded: %s", step, exc)
            return
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        self.last_saved = SavedCheckpoint(step, epoch, path, size_bytes, sha256)
        log.info("checkpoint step=%d written (%d bytes) to %s", step, size_bytes, path)
        self._rotate()

    def _rotate(self) -> None:
        try:
            with self._db.session() as session:
                old = list_checkpoints(session, self.job_id)[self.keep :]
                mark_checkpoints_deleted(session, self.job_id, [c.step for c in old])
                paths = [Path(c.path) for c in old]
        except DatabaseUnavailableError as exc:
            log.warning("checkpoint rotation skipped: %s", exc)
            return
        for path in paths:
            with contextlib.suppress(NotFoundError, FileNotFoundError):
                artifacts.confine(self._artifact_dir, path).unlink()


def make_checkpointer(
    rank: int, db: Database, artifact_dir: Path, job_id: int, attempt: int, *, keep: int
) -> NullCheckpointer:
    """The one place that decides who writes checkpoints: a Checkpointer on rank 0."""
    if rank == 0:
        return Checkpointer(db, artifact_dir, job_id, attempt, keep=keep)
    return NullCheckpointer()


def find_resume_checkpoint(db: Database, artifact_dir: Path, job_id: int) -> int | None:
    """The step of the newest recorded checkpoint whose file exists with the recorded size and
    sha256. Corrupt or missing ones are logged and marked deleted so rotation ignores them.

    Returns:
        The step, or None when there is nothing to resume from.
    """
    with db.session(write=False) as session:
        candidates = [(c.step, c.size_bytes, c.sha256) for c in list_checkpoints(session, job_id)]
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
        with db.session() as session:
            mark_checkpoints_deleted(session, job_id, bad)
    return chosen


def agree_on_resume(ctx: DistContext, db: Database, artifact_dir: Path, job_id: int) -> Path | None:
    """Rank 0 picks the checkpoint to resume from and broadcasts its step; every rank returns
    the same path (None: start from scratch). A collective: all ranks must call it."""
    step = 0
    if ctx.rank == 0:
        step = find_resume_checkpoint(db, artifact_dir, job_id) or 0
    step = broadcast_int(step, ctx)
    return artifacts.checkpoint_path(artifact_dir, job_id, step) if step > 0 else None


def load_checkpoint_file(path: Path, device: torch.device) -> dict[str, Any]:
    """Load one of our own checkpoint files onto ``device`` (weights_only=False: it holds RNG
    states and optimizer state written by ddpq itself)."""
    state = torch.load(path, map_location=device, weights_only=False)
    if not isinstance(state, dict):
        raise ValueError(f"{path} does not hold a checkpoint dict")
    return state
