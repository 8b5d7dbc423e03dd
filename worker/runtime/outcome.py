"""How a rank ends: its exit codes and the result / error files the worker reads."""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from service.core import artifacts

EXIT_OK = 0
EXIT_FAILED = 1
# The job was fenced off (requeued or finished elsewhere) while this attempt ran.
EXIT_STALE = 75
# A rank that stops on a signal exits 128 + signum (SIGTERM → 143), like a shell would report.
SIGNAL_EXIT_BASE = 128

# Why a rank failed: the ``reason`` of its error file. A job's error text starts with
# ``"<reason>: "`` for every reason but ``error`` (``error_headline``), e.g. ``"stalled: …"``.
REASON_ERROR = "error"  # an exception in the rank (the default)
REASON_STALLED = "stalled"  # no step finished for training.stall_timeout_s (watchdog.py)
REASON_NONFINITE_LOSS = "nonfinite_loss"  # training.nonfinite_loss=fail (nonfinite.py)
# An exception before the attempt's first step finished (import error, bad config, missing
# file): retrying the same spec would fail the same way.
REASON_SETUP = "setup"
FAILURE_REASONS = (REASON_ERROR, REASON_STALLED, REASON_NONFINITE_LOSS, REASON_SETUP)


def mark_before_first_step(exc: BaseException) -> None:
    """Give ``exc`` the reason ``setup`` (raised before the attempt's first step finished),
    unless it carries another reason already (a stall, a non-finite loss)."""
    if getattr(exc, "reason", REASON_ERROR) == REASON_ERROR:
        with contextlib.suppress(AttributeError, TypeError):  # e.g. a frozen exception type
            exc.reason = REASON_SETUP  # type: ignore[attr-defined]


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as JSON to ``path`` via a temp file, fsync and rename (never partial)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
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

    ``final_metrics`` values must be JSON-safe (see ``service.store.metrics.json_safe``).
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
) -> Path:
    """Record why ``rank`` failed: ``{rank, reason, exc_type, message, traceback, time}``.

    ``at_s`` is when the exception was caught (epoch seconds), so the worker can name the
    earliest failing rank; collateral failures of other ranks come later. ``reason`` is the
    exception's ``reason`` attribute when it has one of ``FAILURE_REASONS``, else
    ``"error"``. ``traceback_text`` replaces the exception's own traceback (the watchdog
    passes the stalled thread's stack: its exception was never raised).
    """
    reason = getattr(exc, "reason", REASON_ERROR)
    path = artifacts.rank_error_path(artifact_dir, job_id, attempt, rank)
    write_json_atomic(
        path,
        {
            "rank": rank,
            "reason": reason if reason in FAILURE_REASONS else REASON_ERROR,
            "exc_type": type(exc).__name__,
            "message": str(exc),
            "traceback": traceback_text or "".join(traceback.format_exception(exc)),
            "time": at_s,
        },
    )
    return path


def error_headline(error: Mapping[str, Any]) -> str:
    """The first line of a job's error, from a rank's error file (as ``write_rank_error``
    wrote it): ``"rank 1 failed: RuntimeError: boom"``, or for another reason than
    ``error`` the reason first: ``"stalled: rank 1 finished no step for …"`` (the message
    of those names the rank itself), ``"setup: rank 0 failed before its first step: …"``."""
    reason = error.get("reason", REASON_ERROR)
    message = error.get("message", "")
    failed = f"rank {error.get('rank', '?')} failed"
    if reason == REASON_SETUP:
        return (
            f"{reason}: {failed} before its first step: {error.get('exc_type', 'Error')}: {message}"
        )
    if reason in FAILURE_REASONS and reason != REASON_ERROR:
        return f"{reason}: {message}"
    return f"{failed}: {error.get('exc_type', 'Error')}: {message}"


def failure_reason(error: str | None) -> str:
    """The reason a job's error text starts with (see ``error_headline``); ``"error"`` for
    any other text."""
    head, sep, _ = (error or "").partition(": ")
    return head if sep and head in FAILURE_REASONS else REASON_ERROR


def now_s() -> float:
    """Wall-clock time in epoch seconds (the ``time`` field of error files)."""
    return time.time()
