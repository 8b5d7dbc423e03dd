"""The worker–rank contract: what a launcher hands every rank process and what a rank leaves
behind for the worker to read.

One home for it, imported by the launchers (worker side) and by the rank runtime alike:

- the environment variable names (``JOB_ID`` … ``PG_TIMEOUT_S``) and ``rank_env()``, the
  ddpq entries of every rank's environment;
- ``ExitCode``: how a rank (or the Slurm task around it) exits;
- ``FailureReason``: why a rank failed, as recorded in its error file and carried by
  ``RunStatus.failure`` to the retry policy (which never parses a human-readable message);
- the result / error files: ``write_result``, ``write_rank_error``, ``read_rank_errors``.

The files' paths are ``service.core.artifacts``'s (the API reads the same layout).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from collections.abc import Iterator, Mapping
from enum import IntEnum, StrEnum
from pathlib import Path
from typing import Any

from service.core import artifacts

# -- environment ---------------------------------------------------------------------------
# Identify the job's processes (operators find them by these) and fence their writes.
JOB_ID = "DDPQ_JOB_ID"
ATTEMPT = "DDPQ_ATTEMPT"
# Where the rank writes its files (logs, checkpoints, result/error files); Settings reads it.
ARTIFACT_DIR = "DDPQ_ARTIFACT_DIR"
# The attempt API the rank reports to, and the per-attempt token it presents there (the only
# secret a rank holds; see service.core.wire.attempt).
API_URL = "DDPQ_API_URL"
ATTEMPT_TOKEN = "DDPQ_ATTEMPT_TOKEN"
# The job's checkpoint directory on the rank's host (shared by its attempts there).
CHECKPOINT_DIR = "DDPQ_CHECKPOINT_DIR"
# A command job's script: the checkpoint step its rank restored before starting it (a followed
# checkpoint file), when it did.
RESUMED_FROM_STEP = "DDPQ_RESUMED_FROM_STEP"
# The worker's database URL: never in a rank's environment (see inherited_env), named here so
# the worker can tell it apart.
DATABASE_URL = "DDPQ_DATABASE_URL"

# Set by torchrun (env:// rendezvous); on Slurm the runtime derives them from SLURM_* vars.
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"

# Optional, read by the rank runtime: seconds a collective may block before the process group
# gives up (init_process_group's timeout). Default: worker.runtime.topology.DEFAULT_PG_TIMEOUT_S.
PG_TIMEOUT_S = "DDPQ_PG_TIMEOUT_S"
# Optional, read by the rank runtime: seconds from a stop signal (cancel, preemption) to the
# first step boundary that sees it, else the rank exits at once (worker.runtime.signals).
STOP_GRACE_S = "DDPQ_STOP_GRACE_S"
# Optional, read by the rank runtime (Settings.checkpoint_transport): how rank 0's checkpoints
# reach the API's store, ``auto`` | ``shared`` | ``upload`` (worker.runtime.checkpoints.transport).
CHECKPOINT_TRANSPORT = "DDPQ_CHECKPOINT_TRANSPORT"
# Seconds a rank stopped by a signal (cancel, preemption, worker shutdown) waits for its stop
# checkpoint's upload before it exits: inside the local launcher's SIGTERM→SIGKILL grace and
# Slurm's signal lead time (DDPQ_SLURM_SIGNAL_DELAY_S, 60 s by default), with the write's time.
STOP_UPLOAD_S = 40.0
# Read by the warm agent (worker.runtime.agent): ``script`` for a command job, whose fork
# server then skips ddpq's trainer imports (the user's script imports its own).
RANK_CODE = "DDPQ_RANK_CODE"
# The user entrypoints a rank may run (fnmatch patterns, JSON list): the ranks check a spec's
# task against it again (Settings.allowed_entrypoints), so the worker passes its own on.
ALLOWED_ENTRYPOINTS = "DDPQ_ALLOWED_ENTRYPOINTS"

# What a rank inherits of the worker's environment (``inherited_env``): an allow-list, so a
# secret of the worker (its database URL, an API token, any DDPQ_* setting) never reaches the
# user's code unless named here. The system's basics, the interpreter's, and the variables
# CUDA, NCCL/gloo, OpenMP/MKL, torch and Slurm read.
INHERITED_NAMES = frozenset(
    {"PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "TZ", "TMPDIR", "TERM", "PYTHONPATH",
     "PYTHONUNBUFFERED", "VIRTUAL_ENV", "LD_LIBRARY_PATH", PG_TIMEOUT_S, STOP_GRACE_S,
     ALLOWED_ENTRYPOINTS, CHECKPOINT_TRANSPORT}
)  # fmt: skip
INHERITED_PREFIXES = (
    "LC_", "CUDA_", "NVIDIA_", "NCCL_", "GLOO_", "OMP_", "MKL_", "KMP_", "TORCH_",
    "TORCHELASTIC_", "MASTER_", "SLURM_",
)  # fmt: skip

# The entries that mark one attempt's processes (``worker.processes.find_tagged_processes``).
TAG_NAMES = (JOB_ID, ATTEMPT, ARTIFACT_DIR)


def rank_env(
    job_id: int,
    attempt: int,
    *,
    artifact_dir: Path | str,
    cpus_per_task: int,
    user_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """ddpq's entries of every rank's environment, whatever the launcher.

    The topology (``RANK`` … ``MASTER_PORT``) comes from torchrun or from Slurm's variables;
    launchers add their own entries (``CUDA_VISIBLE_DEVICES``, ``API_URL``,
    ``ATTEMPT_TOKEN``) beside these, over ``inherited_env`` of the worker's environment.

    Args:
        job_id, attempt: the attempt the processes belong to (also their tags).
        artifact_dir: the artifact root the ranks write under.
        cpus_per_task: ``resources.cpus_per_task``, the ranks' ``OMP_NUM_THREADS``.
        user_env: the spec's ``env`` (validated: no ``DDPQ_*`` name, none torchrun sets);
            it may replace ``OMP_NUM_THREADS`` and ``PYTHONUNBUFFERED``.
    """
    return {
        "OMP_NUM_THREADS": str(cpus_per_task),
        "PYTHONUNBUFFERED": "1",
        **(user_env or {}),
        JOB_ID: str(job_id),
        ATTEMPT: str(attempt),
        ARTIFACT_DIR: str(artifact_dir),
        CHECKPOINT_DIR: str(artifacts.checkpoint_dir(Path(artifact_dir), job_id)),
    }


def stop_upload_marker(artifact_dir: Path, job_id: int, attempt: int) -> Path:
    """The file rank 0 keeps in its attempt directory while it uploads its stop checkpoint
    (after a stop signal): the local launcher then waits up to ``STOP_UPLOAD_S`` more before
    it SIGKILLs the attempt."""
    return artifacts.attempt_dir(artifact_dir, job_id, attempt) / "stop-upload"


def inherited_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The entries of the worker's ``environ`` a rank inherits: ``INHERITED_NAMES`` and names
    starting with one of ``INHERITED_PREFIXES``. Everything else (``DDPQ_DATABASE_URL``,
    ``DDPQ_TOKEN``, every other ``DDPQ_*`` of the worker, a cloud key) is dropped; the
    launcher adds the rank's own entries (``rank_env``, the API URL and attempt token) on top.
    """
    return {
        name: value
        for name, value in environ.items()
        if name in INHERITED_NAMES or name.startswith(INHERITED_PREFIXES)
    }


def attempt_tags(job_id: int, attempt: int, artifact_dir: Path | str) -> frozenset[bytes]:
    """The ``NAME=value`` environment entries (bytes, as in ``/proc/<pid>/environ``) that
    mark one attempt's processes: its job id, attempt and artifact root."""
    values = {JOB_ID: job_id, ATTEMPT: attempt, ARTIFACT_DIR: artifact_dir}
    return frozenset(f"{name}={values[name]}".encode() for name in TAG_NAMES)


# -- exit codes ----------------------------------------------------------------------------


class ExitCode(IntEnum):
    """How a rank process (or the Slurm task that runs it) exits.

    A rank stopped by a signal exits ``SIGNAL_BASE + signum`` (SIGTERM → 143), as a shell
    reports it; ``signal_exit`` builds that code.
    """

    OK = 0
    FAILED = 1  # the rank wrote error-rank-<rank>.json
    FENCED = 75  # the attempt was fenced off (requeued or finished elsewhere) while it ran
    # Slurm's task turns the runtime's 128 + SIGUSR1 into these (Slurm's accounting garbles
    # codes above 128): stopped on Slurm's warning, checkpointed, to be relaunched ...
    PREEMPTED = 85
    # ... or the same stop because the time limit is near: relaunching would hit it again.
    TIME_LIMIT = 86
    SIGNAL_BASE = 128


def signal_exit(signum: int) -> int:
    """The exit code of a rank stopped by signal ``signum``: ``128 + signum``."""
    return int(ExitCode.SIGNAL_BASE) + int(signum)


# -- failure reasons -----------------------------------------------------------------------


class FailureReason(StrEnum):
    """Why an attempt failed: the ``reason`` of a rank's error file, and
    ``RunStatus.failure`` for the worker's retry policy.

    A job's error text starts with ``"<reason>: "`` for every reason but ``error``
    (``error_headline``); that text is for people, the policy reads this value.
    """

    ERROR = "error"  # an exception in the rank (the default)
    STALLED = "stalled"  # no step finished for training.stall_timeout_s (watchdog.py)
    NONFINITE_LOSS = "nonfinite_loss"  # training.nonfinite_loss=fail (nonfinite.py)
    # An exception before the attempt's first step finished (import error, bad config,
    # missing file): retrying the same spec would fail the same way.
    SETUP = "setup"

    @classmethod
    def of(cls, value: object) -> FailureReason:
        """``value`` as a reason; ``ERROR`` for anything that is not one."""
        try:
            return cls(str(value))
        except ValueError:
            return cls.ERROR


def reason_of(exc: BaseException) -> FailureReason:
    """The reason an exception carries (its ``reason`` attribute), else ``ERROR``."""
    return FailureReason.of(getattr(exc, "reason", FailureReason.ERROR))


def mark_before_first_step(exc: BaseException) -> None:
    """Give ``exc`` the reason ``setup`` (raised before the attempt's first step finished),
    unless it carries another reason already (a stall, a non-finite loss)."""
    if reason_of(exc) == FailureReason.ERROR:
        with contextlib.suppress(AttributeError, TypeError):  # e.g. a frozen exception type
            exc.reason = FailureReason.SETUP  # type: ignore[attr-defined]


# -- result and error files ----------------------------------------------------------------


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as JSON to ``path`` via a temp file, fsync and rename (never partial)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = artifacts.temporary_path(path)
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(payload, fh, indent=2, allow_nan=False, default=str)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_result(
    artifact_dir: Path,
    job_id: int,
    attempt: int,
    *,
    step: int,
    final_metrics: dict[str, Any],
    checkpoint: str | None,
) -> Path:
    """Rank 0's success record, written after metrics and checkpoints are flushed and before
    teardown: ``{"status": "succeeded", "step", "final_metrics", "checkpoint"}``.

    ``final_metrics`` values must be JSON-safe (NaN and infinities as the attempt API encodes them).
    """
    path = artifacts.result_path(artifact_dir, job_id, attempt)
    write_json_atomic(
        path,
        {
            "status": "succeeded",
            "step": int(step),
            "final_metrics": final_metrics,
            "checkpoint": checkpoint,
        },
    )
    return path


def write_rank_error(
    artifact_dir: Path,
    job_id: int,
    attempt: int,
    rank: int,
    exc: BaseException,
    at_s: float,
    *,
    traceback_text: str | None = None,
    exc_type: str | None = None,
) -> Path:
    """Record why ``rank`` failed: ``{rank, reason, exc_type, message, traceback, time}``.

    ``at_s`` is when the exception was caught (epoch seconds), so the worker can name the
    earliest failing rank; collateral failures of other ranks come later. ``reason`` is
    ``reason_of(exc)``. ``traceback_text`` replaces the exception's own traceback (the
    watchdog passes the stalled thread's stack: its exception was never raised), and
    ``exc_type`` its type's name (a user's script: the exception its traceback named).
    """
    path = artifacts.rank_error_path(artifact_dir, job_id, attempt, rank)
    write_json_atomic(
        path,
        {
            "rank": rank,
            "reason": str(reason_of(exc)),
            "exc_type": exc_type or type(exc).__name__,
            "message": str(exc),
            "traceback": traceback_text or "".join(traceback.format_exception(exc)),
            "time": at_s,
        },
    )
    return path


def mark_finished(artifact_dir: Path, job_id: int, attempt: int, rank: int) -> None:
    """Leave the marker of a rank whose training code returned (``rank_finished_name``): a
    peer's "connection closed" after it is then not blamed on its teardown. Best effort."""
    path = artifacts.attempt_dir(artifact_dir, job_id, attempt) / artifacts.rank_finished_name(rank)
    with contextlib.suppress(OSError):
        path.touch()


def read_rank_errors(attempt_dir: Path) -> Iterator[dict[str, Any]]:
    """Every readable ``error-rank-*.json`` of one attempt directory (unreadable or
    malformed files are skipped: a rank may have died while writing)."""
    for path in artifacts.rank_error_files(attempt_dir):
        try:
            data = json.loads(path.read_text(errors="replace"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            yield data


def error_headline(error: Mapping[str, Any]) -> str:
    """The first line of a job's error, from a rank's error file (as ``write_rank_error``
    wrote it): ``"rank 1 failed: RuntimeError: boom"``, or for another reason than
    ``error`` the reason first: ``"stalled: rank 1 finished no step for …"`` (the message
    of those names the rank itself), ``"setup: rank 0 failed before its first step: …"``."""
    reason = FailureReason.of(error.get("reason", FailureReason.ERROR))
    message = error.get("message", "")
    failed = f"rank {error.get('rank', '?')} failed"
    exc_type = error.get("exc_type", "Error")
    if reason == FailureReason.SETUP:
        return f"{reason}: {failed} before its first step: {exc_type}: {message}"
    if reason != FailureReason.ERROR:
        return f"{reason}: {message}"
    return f"{failed}: {exc_type}: {message}"


def now_s() -> float:
    """Wall-clock time in epoch seconds (the ``time`` field of error files)."""
    return time.time()
