"""Rank 0's upload transport, the checkpointer's half for hosts that share no filesystem with
the API: publish the written file locally (this host's copy, for a resume here), hand it to
the uploader thread (``worker.runtime.checkpoints.uploader``), prune the local copies the
service no longer lists once an upload committed, and at ``close`` wait for the upload in
flight (after a stop signal at most ``stop_upload_s``, with the marker file that tells the
local launcher to hold its SIGKILL meanwhile).

``worker.runtime.checkpoints.saver.Checkpointer`` owns one and decides when it is used.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from service.core import artifacts
from service.core.errors import StaleAttemptError
from worker.attempt import stop_upload_marker
from worker.runtime.attempt_client import ApiUnavailableError, AttemptClient, AttemptRequestError
from worker.runtime.checkpoints.files import describe_write_error, publish_checkpoint
from worker.runtime.checkpoints.uploader import CheckpointUploader, UploadItem

log = logging.getLogger(__name__)


class UploadTransport:
    """Publish, then upload in the background; one uploader thread, made at the first upload.

    Args:
        client: the attempt API client (shared with the checkpointer, which closes it).
        on_committed: called in the uploader's thread with each committed item.
        on_failed: called with ``(step, reason)`` for a save that could not be published or
            uploaded (the checkpointer logs it and notes it as a job event).
        on_stale: called with the reason when the attempt was fenced off.
        keep_step: the newest step asked for (never pruned: it may still be on its way).
    """

    def __init__(
        self,
        client: AttemptClient,
        artifact_dir: Path,
        job_id: int,
        attempt: int,
        *,
        on_committed: Callable[[UploadItem], None],
        on_failed: Callable[[int, str], None],
        on_stale: Callable[[str], None],
        keep_step: Callable[[], int | None],
    ) -> None:
        self._client, self._artifact_dir = client, artifact_dir
        self.job_id, self.attempt = job_id, attempt
        self._on_committed, self._on_failed, self._on_stale = on_committed, on_failed, on_stale
        self._keep_step = keep_step
        self._uploader: CheckpointUploader | None = None

    def publish_and_upload(self, item: UploadItem, tmp: Path) -> None:
        """Rename ``tmp`` into place at ``item.path`` (this host's copy), then hand the file to
        the uploader thread; returns at once. A failed rename is a failed save."""
        try:
            publish_checkpoint(tmp, item.path)
        except OSError as exc:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            self._on_failed(item.step, describe_write_error(exc))
            return
        if self._uploader is None:
            self._uploader = CheckpointUploader(
                self._client,
                on_committed=self._committed,
                on_failed=self._on_failed,
                on_stale=self._on_stale,
            )
        log.info("checkpoint step=%d written (%d bytes) to %s; uploading", item.step,
                 item.size_bytes, item.path)  # fmt: skip
        self._uploader.submit(item)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until every upload is done (or ``timeout_s`` seconds); True when idle."""
        return self._uploader is None or self._uploader.wait_idle(timeout_s)

    def close(self, *, stopping: bool, stop_upload_s: float, step: int) -> None:
        """Wait for the uploads, then stop the thread; after a stop signal (``stopping``) at
        most ``stop_upload_s``, past which the upload of ``step`` is abandoned and reported
        failed."""
        uploader = self._uploader
        if uploader is None:
            return
        if stopping and uploader.busy:
            marker = stop_upload_marker(self._artifact_dir, self.job_id, self.attempt)
            with contextlib.suppress(OSError):
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()
            try:
                if not uploader.wait_idle(stop_upload_s):
                    uploader.abandon()
                    self._on_failed(
                        step,
                        f"upload of the stop checkpoint did not finish within "
                        f"{stop_upload_s:g} s of the stop signal",
                    )
                    uploader.close(timeout_s=1.0)
                    return
            finally:
                with contextlib.suppress(OSError):
                    marker.unlink()
        uploader.close()

    def _committed(self, item: UploadItem) -> None:
        self._on_committed(item)
        self._prune_local()

    def _prune_local(self) -> None:
        """Delete this host's checkpoint files the service no longer lists (its retention
        decides), except the newest asked for. Best effort."""
        try:
            live = {entry.step for entry in self._client.list_checkpoints()}
        except (ApiUnavailableError, AttemptRequestError, StaleAttemptError) as exc:
            log.warning("local checkpoint copies not pruned: %s", exc)
            return
        newest = self._keep_step()
        keep = live | ({newest} if newest is not None else set())
        directory = artifacts.checkpoint_dir(self._artifact_dir, self.job_id)
        for path in directory.glob(artifacts.CHECKPOINT_GLOB):
            step = artifacts.parse_checkpoint_name(path.name)
            if step is not None and step not in keep:
                with contextlib.suppress(OSError):
                    path.unlink()
