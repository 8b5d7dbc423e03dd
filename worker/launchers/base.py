"""The Launcher interface: a side-effect-free ``plan`` and the calls that act on it."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from service.core.spec import JobSpec
from worker.attempt import ATTEMPT_TOKEN, FailureReason

# Plan entries whose value is a secret: rendered as MASKED, never printed or logged.
SECRET_ENV_NAMES = frozenset({ATTEMPT_TOKEN})
MASKED = "***"
# The password of a URL (``scheme://user:password@host``), should any plan value hold one.
URL_PASSWORD_RE = re.compile(r"(://[^:/@\s]+:)[^@\s]+@")


def masked(name: str, value: str) -> str:
    """``value`` as a plan shows it: ``***`` for a secret entry, a URL's password masked."""
    return MASKED if name in SECRET_ENV_NAMES else URL_PASSWORD_RE.sub(rf"\1{MASKED}@", value)


class RunPhase(StrEnum):
    """What a launcher observed of one attempt (mapped to JobState by the worker loop)."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"  # relaunch without counting against max_restarts


@dataclass(frozen=True)
class RunStatus:
    """A launcher's observation: the phase plus a human-readable reason when it ended badly.

    ``failure`` is why a FAILED attempt failed, as a value: the retry policy reads it, never
    ``reason`` (text for people, free to be reworded). None when the phase is not FAILED;
    a FAILED status without one counts as ``FailureReason.ERROR``.
    """

    phase: RunPhase
    reason: str | None = None
    exit_code: int | None = None
    failure: FailureReason | None = None


# What a launcher needs beyond argv/env to start its plan: a frozen dataclass of its own
# (``LocalRequest``, ``SlurmBatchRequest``), the launcher's half of the plan's type.
RequestT = TypeVar("RequestT")


@dataclass(frozen=True)
class LaunchPlan(Generic[RequestT]):
    """Everything needed to start one attempt, as plain values (printable, golden-tested).

    ``argv``/``env``/``cwd`` start the processes; ``script`` holds a rendered batch script
    where the backend has one (Slurm). ``env`` holds what the launcher adds to the part of the
    worker's environment ranks inherit (``worker.attempt.inherited_env``), the attempt token
    included once the loop minted it (``with_attempt_token``; rendered masked). ``files`` are
    written into the attempt directory (``log_dir``) before the processes start: name
    (relative to it) → text, e.g. the spec as ``spec.json``. ``request`` is the launcher's own
    typed part of the plan (e.g. a timeout, the sbatch parameters); None only in plans no
    launcher made (tests' fakes).
    """

    launcher: str
    job_id: int
    attempt: int
    argv: list[str]
    env: dict[str, str]
    cwd: str
    log_dir: str
    script: str | None = None
    request: RequestT | None = None
    files: dict[str, str] = field(default_factory=dict)

    def render(self) -> str:
        """The plan as text: environment (secrets masked), the files it writes (their
        names: a spec's text is the job's, shown elsewhere), command line, and the script if
        any."""
        lines = [f"# ddpq job {self.job_id} attempt {self.attempt} via {self.launcher}"]
        lines += [f"export {k}={masked(k, v)}" for k, v in sorted(self.env.items())]
        lines += [f"# writes {self.log_dir}/{name} (mode 0600)" for name in sorted(self.files)]
        lines.append(f"cd {self.cwd}")
        lines.append(" ".join(self.argv))
        if self.script:
            lines += ["", self.script]
        return "\n".join(lines)


def with_attempt_token(plan: LaunchPlan[RequestT], token: str) -> LaunchPlan[RequestT]:
    """``plan`` with the attempt token the worker minted for it in the ranks' environment
    (``worker.attempt.ATTEMPT_TOKEN``); touches nothing."""
    return replace(plan, env={**plan.env, ATTEMPT_TOKEN: token})


def write_plan_files(plan: LaunchPlan[Any], *, owner: tuple[int, int] | None = None) -> None:
    """Write the plan's ``files`` into its attempt directory (``log_dir``), mode 0600.

    Each file is created fresh (``O_EXCL`` on a temp name, then renamed), so a symlink or a
    file left in the directory is never written through.

    Args:
        owner: (uid, gid) to give each file (the rank user's), else the caller's.
    Raises:
        OSError: a file could not be written or given away.
        ValueError: a file name is not a plain name (a path).
    """
    directory = Path(plan.log_dir)
    for name, text in plan.files.items():
        if Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"plan file {name!r}: only plain file names, no paths")
        path = directory / name
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            if owner is not None:
                os.fchown(fd, *owner)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fd = -1
                fh.write(text)
        finally:
            if fd >= 0:
                os.close(fd)
        os.replace(tmp, path)


class Launcher(Protocol):
    """How a worker starts, follows and stops an attempt on one kind of backend."""

    name: str

    def plan(self, spec: JobSpec, job_id: int, attempt: int) -> LaunchPlan[Any]:
        """Build the plan for one attempt; touches nothing."""
        ...

    def bind_gpus(self, plan: LaunchPlan[Any], gpus: Sequence[int]) -> LaunchPlan[Any]:
        """``plan`` bound to the host GPU ids the worker assigned to the attempt (only called
        for launchers whose traits say ``host_gpus``, with a non-empty ``gpus``); touches
        nothing. A launcher whose backend places GPUs itself returns ``plan`` unchanged."""
        ...

    def start(self, plan: LaunchPlan[Any]) -> str:
        """Start the attempt; returns a handle id (a process group id or Slurm job id)."""
        ...

    def poll(self, handle: str) -> RunStatus:
        """Observe the attempt behind ``handle``."""
        ...

    def cancel(self, handle: str) -> None:
        """Stop the attempt; idempotent."""
        ...


@runtime_checkable
class BatchPoller(Protocol):
    """A launcher that observes many attempts with one backend query (Slurm: one sacct)."""

    def poll_many(self, handles: list[str]) -> dict[str, RunStatus]:
        """The status of every handle in ``handles``."""
        ...
