"""A rank's stdout/stderr redirected into its log file, and its logging set up to go there."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

LOG_FORMAT = (
    "%(asctime)s %(levelname)s job_id=%(job_id)s attempt=%(attempt)s rank=%(rank)s "
    "%(name)s: %(message)s"
)


class _RankFields(logging.Filter):
    """Stamps every record with the rank's identity (structured log fields)."""

    def __init__(self, job_id: int, attempt: int, rank: int) -> None:
        super().__init__()
        self.fields = {"job_id": job_id, "attempt": attempt, "rank": rank}

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in self.fields.items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def open_log_pipe(pipe_path: Path) -> int | None:
    """A blocking write descriptor on the FIFO ``pipe_path`` that the local worker reads (it
    caps what it reads into the rank's log, ``worker.launchers.local.attempt_logs``); None
    when there is no such FIFO or no reader (Slurm, an in-process caller)."""
    try:
        if not stat.S_ISFIFO(os.stat(pipe_path, follow_symlinks=False).st_mode):
            return None
        fd = os.open(pipe_path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # absent, or ENXIO: nobody reads it
        return None
    os.set_blocking(fd, True)
    return fd


@contextlib.contextmanager
def redirect_output(log_path: Path, pipe_path: Path | None = None) -> Iterator[None]:
    """Point file descriptors 1 and 2 at the worker's FIFO ``pipe_path`` when it has one,
    else at ``log_path`` (appending; directories created), and ``sys.stdout``/``sys.stderr``
    at them, line-buffered; restore all of it on exit.

    Everything the rank prints, including C++ warnings of torch/gloo and whatever its user
    code or a child writes to fds 1/2, lands in the log (capped by the worker when piped).
    """
    _flush_std()
    fd = open_log_pipe(pipe_path) if pipe_path is not None else None
    if fd is None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    saved = (os.dup(1), os.dup(2))
    saved_streams = (sys.stdout, sys.stderr)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        # New stream objects on fds 1/2, in case the caller had replaced sys.stdout/stderr
        # (submitit, pytest): Python-level writes must land in the file too.
        sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
        yield
    finally:
        _flush_std()
        sys.stdout, sys.stderr = saved_streams
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for each in (*saved, fd):
            os.close(each)


@contextlib.contextmanager
def rank_logging(job_id: int, attempt: int, rank: int) -> Iterator[None]:
    """Send INFO and above of every logger to stderr, stamped with job_id/attempt/rank."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.addFilter(_RankFields(job_id, attempt, rank))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    # httpx logs every request at INFO: a rank's log is the user's output, not ddpq's traffic.
    quiet = logging.getLogger("httpx")
    old_quiet = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        quiet.setLevel(old_quiet)
