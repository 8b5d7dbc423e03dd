"""Process plumbing shared by the worker and its ranks (Linux): the parent-death signal,
making a process non-dumpable, the ``/proc/<pid>/environ`` tag scan that finds an attempt's
processes, and leaving a process without interpreter teardown.

Imports nothing of ddpq's, so both sides of the worker–rank contract may use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_PR_SET_DUMPABLE = 4
_PR_GET_DUMPABLE = 3


def set_parent_death_signal(sig: signal.Signals) -> bool:
    """Have the kernel send ``sig`` to this process when its parent (thread) exits.

    Returns:
        True when armed; False off Linux or when ``prctl`` refused (logged).
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
        return False
    return True


def make_undumpable() -> bool:
    """Make this process non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``).

    Its ``/proc/<pid>/environ``, ``mem``, ``maps`` … become root's, and ptrace needs
    CAP_SYS_PTRACE: a rank running as the same user cannot read the worker's database URL
    from its environment or its memory. The flag survives fork but not ``execve`` of a
    readable binary, so the ranks (torchrun's children) stay dumpable and the worker can
    still find them by their environment tags. No core dumps of this process are written.

    Returns:
        True when set; False off Linux or when ``prctl`` refused (logged).
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_DUMPABLE, 0) failed: %s", os.strerror(ctypes.get_errno()))
        return False
    return True


def is_dumpable() -> bool:
    """Whether this process is dumpable (``prctl(PR_GET_DUMPABLE)``); True off Linux."""
    if not sys.platform.startswith("linux"):
        return True
    return bool(ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0))


def parent_death_preexec(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child receive ``sig`` when its parent *thread* dies.

    Call ``Popen`` from a long-lived thread: Linux sends the signal when the thread that
    forked exits. If the parent is already gone when the child runs, it signals itself.
    """
    parent_pid = os.getpid()

    def _preexec() -> None:
        set_parent_death_signal(sig)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), sig)

    return _preexec


def environ_entries(pid: int) -> set[bytes] | None:
    """The ``NAME=value`` entries of process ``pid``'s initial environment, or None when it
    cannot be read (gone, another user's, or a zombie's empty one reads as an empty set)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return set(f.read().split(b"\0"))
    except OSError:
        return None


def has_tags(pid: int, tags: frozenset[bytes]) -> bool:
    """Whether process ``pid``'s environment holds every entry of ``tags``."""
    entries = environ_entries(pid)
    return entries is not None and tags <= entries


def find_tagged_processes(tags: frozenset[bytes]) -> list[int]:
    """Pids of live processes (other than this one) whose initial environment holds every
    entry of ``tags`` (see ``worker.attempt.attempt_tags``).

    Only our own user's processes are readable; zombies have an empty environment and are
    skipped.
    """
    me = os.getpid()
    return [
        int(entry.name)
        for entry in os.scandir("/proc")
        if entry.name.isdigit() and int(entry.name) != me and has_tags(int(entry.name), tags)
    ]


def exit_now(code: int, *, shutdown_logging: bool = True) -> NoReturn:
    """Flush logging and the standard streams, then leave with ``code`` without interpreter
    teardown (``os._exit``): torch/gloo destructors sometimes abort a process at exit, and a
    stuck thread would block a normal exit.

    ``shutdown_logging=False`` skips ``logging.shutdown`` (a watchdog leaving for a stuck
    thread: that thread may hold a handler's lock).
    """
    if shutdown_logging:
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
