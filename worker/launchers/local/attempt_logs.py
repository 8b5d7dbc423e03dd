"""An attempt's output, read by the worker and written capped: torchrun's stdout/stderr into
``launcher.log`` and each rank's fds 1/2 into ``rank-<r>.log``
(``DDPQ_RANK_LOG_MAX_BYTES``, ``worker.launchers.local.capped_log``).

Why the worker, not the rank: a rank runs the user's code, which may write to fds 1 and 2
directly (``os.write``, a C extension, a subprocess) and, as the rank user, could remove any
limit it kept itself. So nothing of the rank's writes to a file: torchrun's output is a pipe
and each rank's is a FIFO (``rank-<r>.log.pipe``, made here before torchrun starts, opened
by ``worker.runtime.rank_output.redirect_output``; the forked ranks of the fork server inherit
no descriptor of ours, so a pipe must be found by name). One thread of the worker per attempt
reads them all and writes the files, which belong to the worker; it discards what is beyond
the cap as fast as it reads, so a rank writing as fast as it can is never stalled by the cap.

The worker keeps a write end of every FIFO open itself, so the thread never sees an end of
file while ranks come and go; ``close`` (after the attempt's processes are gone) drains what
is left and closes everything.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import selectors
import threading
from pathlib import Path

from service.core import artifacts
from worker.launchers.local.capped_log import CappedLog

log = logging.getLogger(__name__)

# Bytes a pipe holds before a writer waits for the reader (Linux's unprivileged maximum,
# /proc/sys/fs/pipe-max-size; the default is 64 KiB): room for a burst while the thread is
# descheduled.
PIPE_BYTES = 1024 * 1024
READ_BYTES = 1024 * 1024


class AttemptLogs:
    """The capped logs of one local attempt (see the module docstring)."""

    def __init__(
        self,
        artifact_dir: Path,
        job_id: int,
        attempt: int,
        nproc: int,
        cap_bytes: int,
        owner: tuple[int, int] | None = None,
    ) -> None:
        """Args:
        artifact_dir, job_id, attempt: whose logs (the attempt directory must exist).
        nproc: the ranks on this host (``rank-0`` … ``rank-<nproc-1>``).
        cap_bytes: most bytes of each log file (``DDPQ_RANK_LOG_MAX_BYTES``).
        owner: ``(uid, gid)`` the FIFOs are given to (the rank user), else the worker's.
        """
        self.job_id, self.attempt = job_id, attempt
        self.cap_bytes = cap_bytes
        self._selector = selectors.DefaultSelector()
        self._logs: dict[int, CappedLog] = {}  # read fd → its file
        self._keep: list[int] = []  # our own write ends of the FIFOs
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.launcher_log = CappedLog(
            artifacts.launcher_log_path(artifact_dir, job_id, attempt), cap_bytes
        )
        self._plan = [
            (
                artifacts.rank_log_pipe_path(artifact_dir, job_id, attempt, rank),
                CappedLog(artifacts.rank_log_path(artifact_dir, job_id, attempt, rank), cap_bytes),
            )
            for rank in range(nproc)
        ]
        self._owner = owner

    def open(self) -> int:
        """Make the FIFOs and torchrun's pipe and start reading them.

        Returns:
            The write end of torchrun's pipe: its stdout and stderr (the caller closes its
            copy once torchrun has it).
        Raises:
            OSError: a FIFO or pipe could not be made (nothing is left open then).
        """
        try:
            for fifo, capped in self._plan:
                os.mkfifo(fifo, 0o600)
                if self._owner is not None:
                    os.chown(fifo, *self._owner, follow_symlinks=False)
                read_fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                self._add(read_fd, capped)
                # Our own writer: the reader sees no end of file between ranks' opens.
                self._keep.append(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))
            read_fd, write_fd = os.pipe()
            self._add(read_fd, self.launcher_log)
        except OSError:
            self.close()
            raise
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(
            target=self._pump, name=f"logs-job-{self.job_id}-{self.attempt}", daemon=True
        )
        self._thread.start()
        return write_fd

    def _add(self, read_fd: int, capped: CappedLog) -> None:
        os.set_blocking(read_fd, False)
        with contextlib.suppress(OSError):  # a smaller pipe only means shorter bursts
            fcntl.fcntl(read_fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self._logs[read_fd] = capped
        self._selector.register(read_fd, selectors.EVENT_READ)

    def _pump(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select():
                if key.fd != self._wake_r:
                    self._read(key.fd)

    def _read(self, fd: int) -> bool:
        """Move what ``fd`` holds now into its log; False at its end (or when empty)."""
        try:
            data = os.read(fd, READ_BYTES)
        except BlockingIOError:
            return False
        except OSError as exc:
            log.error("job_id=%d attempt=%d: reading a log pipe failed: %s",
                      self.job_id, self.attempt, exc)  # fmt: skip
            data = b""
        if not data:  # every writer of torchrun's pipe is gone
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(fd)
            return False
        self._logs[fd].write(data)
        return True

    def close(self) -> None:
        """Stop the thread, write what the pipes still hold, close every file and pipe and
        remove the FIFOs. Idempotent; call once the attempt's processes are gone (what a
        survivor writes later is lost)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join()
        for fd, capped in self._logs.items():
            while self._read(fd):
                pass
            os.close(fd)
            capped.close()
        for fd in (*self._keep, self._wake_r, self._wake_w):
            os.close(fd)
        self._selector.close()
        for fifo, _ in self._plan:
            with contextlib.suppress(OSError):
                fifo.unlink()

    @property
    def cut_bytes(self) -> dict[str, int]:
        """Bytes cut so far from each log that was cut, by file name."""
        every = [self.launcher_log, *(capped for _, capped in self._plan)]
        return {c.path.name: c.cut_bytes for c in every if c.cut_bytes}
