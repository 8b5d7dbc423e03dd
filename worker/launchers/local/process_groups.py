"""Signalling one local attempt's processes: torchrun's process group and every group its
ranks live in.

Ranks may live in sessions of their own (torchrun starts a script entry that way), so
signalling torchrun's process group need not reach them. Every process of an attempt carries
its tags in its environment (``DDPQ_JOB_ID``, ``DDPQ_ATTEMPT``, ``DDPQ_ARTIFACT_DIR``:
``worker.attempt.attempt_tags``), so the groups to signal are torchrun's plus those of every
tagged process, never the caller's own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

from worker.processes import find_tagged_processes


def attempt_groups(popen: subprocess.Popen[bytes], tags: frozenset[bytes]) -> set[int]:
    """The process group ids of the attempt: torchrun's (while it is unreaped) and those of
    every live process carrying ``tags``, less this process's own group."""
    groups = {popen.pid} if popen.returncode is None else set()
    for pid in find_tagged_processes(tags):
        with contextlib.suppress(ProcessLookupError):
            groups.add(os.getpgid(pid))
    groups.discard(os.getpgrp())
    return groups


def signal_attempt(
    popen: subprocess.Popen[bytes], tags: frozenset[bytes], sig: signal.Signals
) -> bool:
    """Send ``sig`` to every process group of the attempt; False when none is left."""
    groups = attempt_groups(popen, tags)
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    return bool(groups)


def term_and_wait(popen: subprocess.Popen[bytes], tags: frozenset[bytes], grace_s: float) -> None:
    """SIGTERM the attempt, then wait up to ``grace_s`` seconds for torchrun to exit and no
    tagged process to be left (what is left then is the caller's to kill)."""
    if not signal_attempt(popen, tags, signal.SIGTERM):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if popen.poll() is not None and not find_tagged_processes(tags):
            return
        time.sleep(0.05)


def kill_attempt(popen: subprocess.Popen[bytes], tags: frozenset[bytes]) -> list[int]:
    """SIGKILL whatever is left of the attempt (a few rounds: a dying rank's children may
    appear meanwhile) and reap torchrun.

    Returns:
        The pids of tagged processes still alive afterwards (none, unless a process is stuck
        in the kernel).
    """
    for _ in range(50):
        if not signal_attempt(popen, tags, signal.SIGKILL):
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=0.1)
    popen.wait()
    return find_tagged_processes(tags)
