"""How a rank ends: its exit codes and the result / error files the worker reads."""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

from service import artifacts

EXIT_OK = 0
EXIT_FAILED = 1
# The job was fenced off (requeued or finished elsewhere) while this attempt ran.
EXIT_STALE = 75
# A rank that stops on a signal exits 128 + signum (SIGTERM → 143), like a shell would report.
SIGNAL_EXIT_BASE = 128


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

    ``final_metrics`` values must be JSON-safe (see ``service.metrics.json_safe``).
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
    artifact_dir: Path, job_id: int, attempt: int, rank: int, exc: BaseException, at_s: float
) -> Path:
    """Record why ``rank`` failed: ``{rank, exc_type, message, traceback, time}``.

    ``at_s`` is when the exception was caught (epoch seconds), so the worker can name the
    earliest failing rank; collateral failures of other ranks come later.
    """
    path = artifacts.rank_error_path(artifact_dir, job_id, attempt, rank)
    write_json_atomic(
        path,
        {
            "rank": rank,
            "exc_type": type(exc).__name__,
            "message": str(exc),
            "traceback": "".join(traceback.format_exception(exc)),
            "time": at_s,
        },
    )
    return path


def now_s() -> float:
    """Wall-clock time in epoch seconds (the ``time`` field of error files)."""
    return time.time()
