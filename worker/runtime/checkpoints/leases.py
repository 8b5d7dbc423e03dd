"""Read leases (Linux ``fcntl(F_SETLEASE, F_RDLCK)``): whether another process holds a file
open for writing, and a window in which none may open it for writing.

A followed checkpoint file belongs to the user's script: ddpq must copy a version the script
finished, never one it is rewriting in place (``torch.save`` opens, truncates, writes and
closes the same file every epoch). The kernel grants a read lease only while no process has the
file open for writing; while one is held, an ``open`` of the file for writing (or a truncate)
waits until the holder releases it (at most ``/proc/sys/fs/lease-break-time``, 45 s by
default) and the holder is sent a signal. That signal is set to ``SIGURG`` (ignored unless a
handler is installed) instead of the default ``SIGIO``, which would end the rank.

A lease needs a local filesystem and a caller that owns the file (the rank's user runs the
script, so it owns what the script writes). Where the kernel grants none for another reason
(NFS, ``/proc/sys/fs/leases-enable`` 0, another owner), nothing is known: ``None``; callers
then fall back to comparing the file's size and mtime before and after.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
from pathlib import Path

# Writers hold the file: the kernel answers EAGAIN (EBUSY on some versions) to a read lease.
_WRITERS = (errno.EAGAIN, errno.EBUSY)
_F_SETLEASE = getattr(fcntl, "F_SETLEASE", 1024)
_F_SETSIG = getattr(fcntl, "F_SETSIG", 10)


def take_read_lease(fd: int) -> bool | None:
    """Take a read lease on ``fd`` (opened read-only).

    Returns:
        True: granted (no process has the file open for writing; until ``release_lease``, an
        open for writing waits). False: a process has it open for writing now. None: the
        kernel grants no lease on this file (see the module's docstring).
    """
    try:
        fcntl.fcntl(fd, _F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_RDLCK)
    except OSError as exc:
        return False if exc.errno in _WRITERS else None
    return True


def release_lease(fd: int) -> None:
    """Release ``fd``'s lease (a writer waiting for it goes on). Never raises."""
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)


def being_written(path: Path) -> bool | None:
    """Whether a process has the regular file at ``path`` open for writing now (symbolic
    links are not followed); None when that cannot be told (no lease, or ``path`` cannot be
    opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        granted = take_read_lease(fd)
        if granted:
            release_lease(fd)
        return None if granted is None else not granted
    finally:
        os.close(fd)
