"""The Launcher interface: a side-effect-free ``plan`` and the calls that act on it."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from service.core import artifacts
from service.core.events import EventKind
from service.core.spec.model import JobSpec
from worker.attempt import ATTEMPT_TOKEN, FailureReason

# Plan entries whose value is a secret: rendered as MASKED, never printed or logged.
SECRET_ENV_NAMES = frozenset({ATTEMPT_TOKEN})
MASKED = "***"
# The password of a URL (``scheme://user:password@host``) wherever a plan's text holds one.
# Greedy up to the last ``@`` of the word: a password may itself hold ``@`` (or ``:``), the
# host never does; masking too much is safe, masking too little is a leak.
URL_PASSWORD_RE = re.compile(r"(://[^:/\s]+:)\S*@")


def mask_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` (an env value, a script, a log line) as a plan shows it: every occurrence of
    each of ``secrets`` (values, e.g. the attempt token) and every URL's password replaced
    by ``***``. The one masking rule for a plan's environment, script and log."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASKED)
    return URL_PASSWORD_RE.sub(rf"\1{MASKED}@", text)


def masked(name: str, value: str) -> str:
    """``value`` of plan entry ``name`` as a plan shows it: ``***`` for a secret entry, else
    ``mask_text(value)``."""
    return MASKED if name in SECRET_ENV_NAMES else mask_text(value)


def secret_values(env: Mapping[str, str]) -> list[str]:
    """The values of ``env``'s secret entries (``SECRET_ENV_NAMES``), to mask wherever else
    they appear (a script, argv)."""
    return [v for k, v in env.items() if k in SECRET_ENV_NAMES and v]


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
    # Job events the launcher saw reason for (``kind``, ``data``: ``service.core.events``),
    # e.g. a rank log cut at its cap; the loop posts them once, before the outcome.
    notes: tuple[tuple[EventKind, Mapping[str, Any]], ...] = ()


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
    launcher made (tests' fakes). ``owner`` is the job's owner once the loop knows it
    (``with_owner``): a root-run local launcher starts the ranks as the owner's Unix user
    (``service.core.owners.rank_users``).
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
    owner: str | None = None
    # What a reader of the plan must know that its commands do not show (one line each).
    notes: tuple[str, ...] = ()

    def render(self) -> str:
        """The plan as text: environment (secrets masked), the files it writes (their
        names: a spec's text is the job's, shown elsewhere), command line, and the script if
        any."""
        secrets = secret_values(self.env)
        lines = [f"# ddpq job {self.job_id} attempt {self.attempt} via {self.launcher}"]
        if self.owner is not None:
            lines.append(f"# owner {self.owner}")
        lines += [f"# note: {note}" for note in self.notes]
        lines += [f"export {k}={masked(k, v)}" for k, v in sorted(self.env.items())]
        lines += [f"# writes {self.log_dir}/{name} (mode 0600)" for name in sorted(self.files)]
        lines.append(f"cd {self.cwd}")
        lines.append(mask_text(" ".join(self.argv), secrets))
        if self.script:
            lines += ["", mask_text(self.script, secrets)]
        return "\n".join(lines)


def with_attempt_token(plan: LaunchPlan[RequestT], token: str) -> LaunchPlan[RequestT]:
    """``plan`` with the attempt token the worker minted for it in the ranks' environment
    (``worker.attempt.ATTEMPT_TOKEN``); touches nothing."""
    return replace(plan, env={**plan.env, ATTEMPT_TOKEN: token})


def with_owner(plan: LaunchPlan[RequestT], owner: str | None) -> LaunchPlan[RequestT]:
    """``plan`` with the job's owner (from the claim), whose Unix user a root-run local
    launcher starts the ranks as; touches nothing."""
    return replace(plan, owner=owner)


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
        tmp = artifacts.temporary_path(path)
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


@dataclass(frozen=True)
class ArrayPlan(Generic[RequestT]):
    """Several attempts started by one backend submission (a Slurm job array), as plain values.

    ``elements`` are the attempts' own plans (``Launcher.plan``, each with its attempt token),
    in element order: element ``i`` runs ``elements[i]``. ``script`` is the one submission
    they share; at most ``parallelism`` elements run at once. ``request`` is the launcher's own
    part (e.g. the array's sbatch parameters).
    """

    launcher: str
    elements: tuple[LaunchPlan[Any], ...]
    parallelism: int
    script: str | None = None
    request: RequestT | None = None

    def render(self) -> str:
        """The array as text: each element's environment (secrets masked) and files, then
        the command line and the shared script."""
        n = len(self.elements)
        secrets = [v for plan in self.elements for v in secret_values(plan.env)]
        lines = [f"# ddpq array of {n} attempt(s) via {self.launcher}, "
                 f"at most {self.parallelism} at once"]  # fmt: skip
        lines += [f"# note: {note}" for note in (self.elements[0].notes if n else ())]
        for i, plan in enumerate(self.elements):
            lines.append(f"# element {i}: job {plan.job_id} attempt {plan.attempt}")
            lines += [f"#   {k}={masked(k, v)}" for k, v in sorted(plan.env.items())]
            lines += [f"#   writes {plan.log_dir}/{name}" for name in sorted(plan.files)]
        if self.elements:
            first = self.elements[0]
            lines += [f"cd {first.cwd}", mask_text(" ".join(first.argv), secrets)]
        if self.script:
            lines += ["", mask_text(self.script, secrets)]
        return "\n".join(lines)


@runtime_checkable
class ArrayStarter(Protocol):
    """A launcher that starts many attempts as one submission (Slurm: a job array). The
    worker claims a batch of one sweep's trials and hands their plans over together."""

    def plan_array(
        self, plans: Sequence[LaunchPlan[Any]], *, parallelism: int | None
    ) -> list[ArrayPlan[Any]]:
        """The submissions that start ``plans`` (each made by ``plan``), in order, with at
        most ``parallelism`` (None: no limit) of each submission's elements running at once;
        several when the backend caps a submission's size. Touches nothing but what it reads
        once of the backend's limits.

        Raises:
            LaunchError: the plans cannot be started as arrays on this backend.
        """
        ...

    def start_array(self, plan: ArrayPlan[Any]) -> list[str]:
        """Start one submission; returns a handle per element, in element order (Slurm: the
        element ids ``<array job id>_<index>``), each followed like ``start``'s handle."""
        ...


@runtime_checkable
class BatchPoller(Protocol):
    """A launcher that observes many attempts with one backend query (Slurm: one sacct)."""

    def poll_many(self, handles: list[str]) -> dict[str, RunStatus]:
        """The status of every handle in ``handles``."""
        ...


@runtime_checkable
class GracefulCanceller(Protocol):
    """A launcher whose ``cancel`` lets the ranks stop cleanly and blocks meanwhile: SIGTERM
    (the ranks write a stop checkpoint), SIGKILL after ``grace_s`` seconds (the local
    launcher). The worker's lease fence stops a job with ``stop_within_grace``, which never
    waits longer, that long plus a margin before a lease it cannot renew may lapse."""

    grace_s: float

    def stop_within_grace(self, handle: str) -> None:
        """``cancel``, but SIGKILL whatever is left after ``grace_s`` seconds, whatever the
        ranks are doing (``cancel`` may wait longer for a stop checkpoint's upload, which
        cannot reach an API the worker is cut off from)."""
        ...


@runtime_checkable
class PendingExplainer(Protocol):
    """A launcher whose backend says why a submitted attempt is still pending (Slurm's
    ``squeue -o %r``), for many attempts with one query."""

    def pending_reasons(self, handles: list[str]) -> dict[str, str]:
        """The backend's reason code (e.g. ``Resources``) of each of ``handles`` that is
        still pending; handles it does not know or that run are left out."""
        ...
