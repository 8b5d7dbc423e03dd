"""What a local attempt's processes may hold: ``RLIMIT_NPROC`` and ``RLIMIT_NOFILE`` on
torchrun (inherited by every rank and everything they start), set in the child between fork
and exec, with its move into the attempt's cgroup (``worker.launchers.local.cgroups``).

Why in the child rather than ``prlimit(pid)`` right after spawn: torchrun could fork before
the parent's call lands, and its children would keep the worker's limits. The launcher already
runs a ``preexec_fn`` (the parent-death signal, which only the child can arm); the limits add
two ``setrlimit`` calls and one ``write`` to it, all plain system calls that take no lock a
thread of the worker could hold, so no new hazard of running code between fork and exec.
CPython calls it after the child's ``setuid`` (a rank user may lower its own limits) and
before it closes the descriptors (the cgroup's ``cgroup.procs``, opened by the worker, is
still there; writing ``0`` moves the writer, judged by the opener's rights).

``RLIMIT_NPROC`` counts every process and thread of the real uid on the host: it bounds all
jobs of that Unix user together, and root ignores it (a worker without ``DDPQ_RANK_USER``
running as root gives its ranks no process bound but the cgroup's).
"""

from __future__ import annotations

import os
import resource
import signal
from collections.abc import Callable
from dataclasses import dataclass

from service.core.config import Settings
from worker.processes import parent_death_preexec

# The text a failure shows when a limit was hit → the setting to raise.
LIMIT_HINTS: tuple[tuple[str, str], ...] = (
    ("Too many open files", "DDPQ_RANK_NOFILE_MAX"),
    ("Resource temporarily unavailable", "DDPQ_RANK_NPROC_MAX"),
    ("can't start new thread", "DDPQ_RANK_NPROC_MAX"),
)


@dataclass(frozen=True)
class RankLimits:
    """The resource limits of an attempt's processes: ``nproc`` (processes and threads of
    its Unix user) and ``nofile`` (open files per process); None keeps the worker's."""

    nproc: int | None = None
    nofile: int | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> RankLimits:
        """``DDPQ_RANK_NPROC_MAX`` and ``DDPQ_RANK_NOFILE_MAX``."""
        return cls(nproc=settings.rank_nproc_max, nofile=settings.rank_nofile_max)

    def rlimits(self) -> list[tuple[int, int]]:
        """``(resource, value)`` pairs to set as both soft and hard limit, each at most this
        process's hard limit (an unprivileged worker cannot raise it)."""
        wanted = ((resource.RLIMIT_NPROC, self.nproc), (resource.RLIMIT_NOFILE, self.nofile))
        pairs = []
        for res, value in wanted:
            if value is None:
                continue
            hard = resource.getrlimit(res)[1]
            pairs.append((res, value if hard == resource.RLIM_INFINITY else min(value, hard)))
        return pairs


def launch_preexec(
    limits: RankLimits, cgroup_procs_fd: int | None = None, sig: signal.Signals = signal.SIGTERM
) -> Callable[[], None]:
    """The ``preexec_fn`` of torchrun's ``Popen``: the parent-death signal
    (``worker.processes.parent_death_preexec``), then the limits, then the move into the
    cgroup whose ``cgroup.procs`` the worker opened as ``cgroup_procs_fd`` (if any).

    A failing call raises in the child, and ``Popen`` raises ``SubprocessError`` in the
    worker: an attempt never starts without its limits.
    """
    parent_death = parent_death_preexec(sig)
    pairs = limits.rlimits()  # computed here: the child only makes system calls

    def _preexec() -> None:
        parent_death()
        for res, value in pairs:
            resource.setrlimit(res, (value, value))
        if cgroup_procs_fd is not None:
            os.write(cgroup_procs_fd, b"0")

    return _preexec


def limit_hint(text: str) -> str | None:
    """The setting to raise when a failure's ``text`` says a process limit was hit
    (``LIMIT_HINTS``), as a sentence; None otherwise."""
    for needle, setting in LIMIT_HINTS:
        if needle in text:
            return f"a process limit may have been hit: raise {setting} if the job needs more"
    return None
