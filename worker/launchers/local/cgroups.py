"""A cgroup v2 per local attempt: ``memory.max`` (``DDPQ_JOB_MEMORY_MAX_BYTES``) and
``pids.max`` (``DDPQ_JOB_PIDS_MAX``) bound the job as a whole, so a rank that forks or
allocates without end ends its own job, not the host.

Where it works: a unified hierarchy (``<root>/cgroup.controllers`` exists) in which the
worker's own cgroup (``0::<path>`` of ``/proc/self/cgroup``) is writable and offers the
``memory`` and ``pids`` controllers. Their use for child cgroups must be enabled in
``cgroup.subtree_control``, which the kernel allows only on a cgroup without processes of
its own, so the worker first moves itself into a leaf child ``ddpq-worker`` (what systemd's
``Delegate=yes`` services and container runtimes do). Attempts get
``ddpq-job-<id>-attempt-<n>`` beside it; torchrun is moved in before it execs
(``worker.launchers.local.process_limits.launch_preexec``) and the cgroup is removed when
the attempt has ended.

Elsewhere (cgroup v1 or hybrid hosts, a read-only ``/sys/fs/cgroup``, controllers not
delegated: most containers) ``probe_cgroups`` says why, the worker logs it once at start, and
attempts run without (the rlimits still apply).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
CONTROLLERS = ("memory", "pids")
WORKER_LEAF = "ddpq-worker"
# Seconds ``remove`` retries rmdir while the kernel still tears the attempt's processes down.
REMOVE_WAIT_S = 5.0


class CgroupUnavailableError(Exception):
    """Per-job cgroups cannot be used on this host; the message says why."""


@dataclass(frozen=True)
class CgroupSupport:
    """Whether per-job cgroups work here: ``parent`` (the cgroup attempts are made in) when
    they do, else None and ``reason`` says why not."""

    parent: Path | None
    reason: str

    @property
    def usable(self) -> bool:
        """Whether attempts get a cgroup."""
        return self.parent is not None


def own_cgroup(proc_self_cgroup: Path = PROC_SELF_CGROUP) -> str | None:
    """This process's cgroup v2 path (the ``0::<path>`` line), or None without one."""
    try:
        lines = proc_self_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            return line[3:]
    return None


def probe_cgroups(
    root: Path = CGROUP_ROOT, proc_self_cgroup: Path = PROC_SELF_CGROUP, *, pid: int = 0
) -> CgroupSupport:
    """Find out whether per-job cgroups work here and make the worker's side ready: move
    process ``pid`` (0: this one) into the leaf ``ddpq-worker`` and enable ``memory`` and
    ``pids`` for the children of its cgroup (see the module docstring).

    Never raises: what does not work is the ``reason`` of an unusable result.
    """
    if not (root / "cgroup.controllers").is_file():
        return CgroupSupport(None, f"no cgroup v2 hierarchy at {root} (cgroup v1 or hybrid)")
    path = own_cgroup(proc_self_cgroup)
    if path is None:
        return CgroupSupport(None, f"{proc_self_cgroup} names no cgroup v2 path")
    parent = root / path.lstrip("/")
    if parent.name == WORKER_LEAF:  # a worker started here before: its parent is ours
        parent = parent.parent
    try:
        available = (parent / "cgroup.controllers").read_text().split()
        missing = [c for c in CONTROLLERS if c not in available]
        if missing:
            raise CgroupUnavailableError(
                f"controller(s) {', '.join(missing)} not delegated to {parent} (its "
                f"cgroup.controllers: {' '.join(available) or 'none'})"
            )
        if not os.access(parent / "cgroup.subtree_control", os.W_OK):
            raise CgroupUnavailableError(f"{parent}/cgroup.subtree_control is not writable")
        enabled = (parent / "cgroup.subtree_control").read_text().split()
        if any(c not in enabled for c in CONTROLLERS):
            leaf = parent / WORKER_LEAF
            leaf.mkdir(exist_ok=True)
            (leaf / "cgroup.procs").write_text(str(pid))
            (parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in CONTROLLERS))
    except CgroupUnavailableError as exc:
        return CgroupSupport(None, str(exc))
    except OSError as exc:
        return CgroupSupport(None, f"cannot set up child cgroups under {parent}: {exc}")
    return CgroupSupport(parent, f"per-job cgroups under {parent}")


def job_cgroup_support(
    pids_max: int | None,
    memory_max_bytes: int | None,
    *,
    root: Path = CGROUP_ROOT,
    proc_self_cgroup: Path = PROC_SELF_CGROUP,
) -> CgroupSupport:
    """Per-job cgroups for a local worker: probed (``probe_cgroups``) when a limit asks for
    one, and said once in the worker's log either way (a warning when unavailable)."""
    if pids_max is None and memory_max_bytes is None:
        return CgroupSupport(None, "DDPQ_JOB_PIDS_MAX and DDPQ_JOB_MEMORY_MAX_BYTES unset")
    support = probe_cgroups(root, proc_self_cgroup)
    if support.usable:
        log.info("jobs run in cgroups of their own: %s", support.reason)
    else:
        log.warning("no per-job cgroups (%s): DDPQ_JOB_PIDS_MAX and DDPQ_JOB_MEMORY_MAX_BYTES "
                    "are not enforced here; the ranks' RLIMIT_NPROC and RLIMIT_NOFILE are",
                    support.reason)  # fmt: skip
    return support


@dataclass
class JobCgroup:
    """One attempt's cgroup: ``path``, and ``procs_fd`` (its ``cgroup.procs``, open for the
    launch's ``preexec_fn``; closed by ``release_procs_fd`` once torchrun runs)."""

    path: Path
    procs_fd: int | None
    pids_max: int | None
    memory_max_bytes: int | None

    @classmethod
    def create(
        cls,
        parent: Path,
        job_id: int,
        attempt: int,
        *,
        pids_max: int | None,
        memory_max_bytes: int | None,
    ) -> JobCgroup:
        """Make ``<parent>/ddpq-job-<id>-attempt-<n>`` with its limits (a leftover of an
        earlier life of the worker is reused).

        Raises:
            OSError: it could not be made or limited (nothing is left behind then).
        """
        path = parent / f"ddpq-job-{job_id}-attempt-{attempt}"
        path.mkdir(exist_ok=True)
        try:
            if pids_max is not None:
                (path / "pids.max").write_text(str(pids_max))
            if memory_max_bytes is not None:
                (path / "memory.max").write_text(str(memory_max_bytes))
                # The kernel kills the whole job at once rather than one rank at random.
                with contextlib.suppress(OSError):
                    (path / "memory.oom.group").write_text("1")
            fd = os.open(path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            with contextlib.suppress(OSError):
                path.rmdir()
            raise
        return cls(path, fd, pids_max, memory_max_bytes)

    def release_procs_fd(self) -> None:
        """Close ``procs_fd`` (idempotent)."""
        if self.procs_fd is not None:
            os.close(self.procs_fd)
            self.procs_fd = None

    def limit_hit(self) -> str | None:
        """A sentence naming the limit the attempt hit (``pids.events`` ``max``,
        ``memory.events`` ``oom_kill``) and the setting to raise; None if none was."""
        if _event_count(self.path / "memory.events", "oom_kill") > 0:
            return (
                f"the job ran out of memory: its cgroup's memory.max is "
                f"{self.memory_max_bytes} bytes (DDPQ_JOB_MEMORY_MAX_BYTES)"
            )
        if _event_count(self.path / "pids.events", "max") > 0:
            return (
                f"the job hit its process limit: pids.max {self.pids_max} processes and "
                "threads (DDPQ_JOB_PIDS_MAX)"
            )
        return None

    def remove(self, wait_s: float = REMOVE_WAIT_S) -> None:
        """Kill what is left in the cgroup (``cgroup.kill``) and remove it, retrying up to
        ``wait_s`` seconds while it is still busy; a cgroup that stays is logged."""
        self.release_procs_fd()
        with contextlib.suppress(OSError):  # absent before Linux 5.14: nothing to kill then
            fd = os.open(self.path / "cgroup.kill", os.O_WRONLY)
            try:
                os.write(fd, b"1")
            finally:
                os.close(fd)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                    log.error("could not remove the cgroup %s: %s", self.path, exc)
                    return
            time.sleep(0.05)


def _event_count(path: Path, key: str) -> int:
    """The ``key N`` count of a cgroup events file; 0 when unreadable."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        return 0
    return 0
