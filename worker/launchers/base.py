"""The Launcher interface: a side-effect-free ``plan`` and the calls that act on it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable

from service.core.spec import JobSpec


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
    """A launcher's observation: the phase plus a human-readable reason when it ended badly."""

    phase: RunPhase
    reason: str | None = None
    exit_code: int | None = None


@dataclass(frozen=True)
class LaunchPlan:
    """Everything needed to start one attempt, as plain values (printable, golden-tested).

    ``argv``/``env``/``cwd`` start the processes; ``script`` holds a rendered batch script
    where the backend has one (Slurm). ``env`` holds only what the launcher adds to the
    worker's environment.
    """

    launcher: str
    job_id: int
    attempt: int
    argv: list[str]
    env: dict[str, str]
    cwd: str
    log_dir: str
    script: str | None = None
    extra: dict[str, str] = field(default_factory=dict)

    def render(self) -> str:
        """The plan as text: environment, command line, and the script if any."""
        lines = [f"# ddpq job {self.job_id} attempt {self.attempt} via {self.launcher}"]
        lines += [f"export {k}={v}" for k, v in sorted(self.env.items())]
        lines.append(f"cd {self.cwd}")
        lines.append(" ".join(self.argv))
        if self.script:
            lines += ["", self.script]
        return "\n".join(lines)


class Launcher(Protocol):
    """How a worker starts, follows and stops an attempt on one kind of backend."""

    name: str

    def plan(self, spec: JobSpec, job_id: int, attempt: int) -> LaunchPlan:
        """Build the plan for one attempt; touches nothing."""
        ...

    def start(self, plan: LaunchPlan) -> str:
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


def is_detached(launcher: Launcher) -> bool:
    """Whether the launcher's attempts keep running when its worker stops (a launcher says so
    with a true ``detached`` attribute, as Slurm's does); such jobs are adopted, not stopped."""
    return bool(getattr(launcher, "detached", False))
