"""The Launcher interface: a side-effect-free ``plan`` and the calls that act on it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from service.core.spec import JobSpec
from worker.attempt import FailureReason


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
    where the backend has one (Slurm). ``env`` holds only what the launcher adds to the
    worker's environment. ``request`` is the launcher's own typed part of the plan (e.g. a
    timeout, the sbatch parameters); None only in plans no launcher made (tests' fakes).
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
