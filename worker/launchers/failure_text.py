"""What a failed attempt says: the earliest rank's error file (``error-rank-N.json``, written
by ``worker.attempt.write_rank_error``) as the job's error text plus its ``FailureReason``,
the tail of a log, an exit code. Shared by the local and Slurm launchers."""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.attempt import FailureReason, error_headline, read_rank_errors

LOG_TAIL_LINES = 20
TRACEBACK_TAIL_LINES = 15
STALL_TAIL_LINES = 10  # five frames: past threading/torch internals to the caller


def describe_exit(rc: int) -> str:
    """``"exit code 3"`` or ``"exit code -6 (SIGABRT)"``."""
    if rc < 0:
        with contextlib.suppress(ValueError):
            return f"exit code {rc} ({signal.Signals(-rc).name})"
    return f"exit code {rc}"


def tail_lines(path: Path, n: int = LOG_TAIL_LINES, max_bytes: int = 64_000) -> str:
    """The last ``n`` lines of a text file (reads at most ``max_bytes`` from its end)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            data = f.read()
    except OSError:
        return "(no output)"
    return "\n".join(data.decode(errors="replace").splitlines()[-n:]) or "(no output)"


# What a rank's collective raises when a peer process died under it (gloo's TCP pairs, NCCL):
# a symptom of another rank's failure, never its cause.
PEER_LOST_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote process exited",
)


def blames_a_silent_rank(attempt_dir: Path, rank: int) -> bool:
    """True when ``rank`` (the launcher's first failed rank) wrote no error file, and every
    error file of the attempt only says that a peer went away (``PEER_LOST_MARKERS``): then
    ``rank`` is the cause (killed, or ``sys.exit``/``os._exit`` in user code) and the others'
    errors are its symptoms."""
    errors = list(read_rank_errors(attempt_dir))
    return bool(errors) and all(
        str(e.get("rank")) != str(rank)
        and any(m in str(e.get("message", "")) for m in PEER_LOST_MARKERS)
        for e in errors
    )


# How many traceback lines follow the headline, per reason. An exception: the traceback's tail.
# A stall: the innermost frames, where the rank is stuck (all stacks are in its log). A
# non-finite loss: none, the headline says it all.
TAIL_LINES_BY_REASON: dict[FailureReason, int] = {
    FailureReason.ERROR: TRACEBACK_TAIL_LINES,
    FailureReason.SETUP: TRACEBACK_TAIL_LINES,
    FailureReason.STALLED: STALL_TAIL_LINES,
}


@dataclass(frozen=True)
class RankFailure:
    """The earliest rank error of an attempt: why (the error file's ``reason``, for the retry
    policy) and what to tell people (``text``: headline plus the traceback's tail)."""

    reason: FailureReason
    text: str


def earliest_failure(attempt_dir: Path) -> RankFailure | None:
    """The error of the rank that failed first (by its ``time``, then rank): its reason, and
    as text ``"rank 1 failed: RuntimeError: boom"`` plus the traceback's last whole frames
    (``TAIL_LINES_BY_REASON``); None if no rank wrote an error file."""

    def key(e: dict[str, Any]) -> tuple[float, int]:
        try:
            return float(e.get("time", 0.0)), int(e.get("rank", 0))
        except (TypeError, ValueError):
            return 0.0, 0

    errors = sorted(read_rank_errors(attempt_dir), key=key)
    if not errors:
        return None
    e = errors[0]
    reason = FailureReason.of(e.get("reason", FailureReason.ERROR))
    head = error_headline(e)  # "rank 1 failed: …", or "stalled: …" / "nonfinite_loss: …"
    tail = TAIL_LINES_BY_REASON.get(reason, 0)
    lines = str(e.get("traceback") or "").rstrip().splitlines()[-tail:] if tail else []
    while lines and not lines[0].startswith(("  File ", "Traceback")):
        lines.pop(0)  # never start in the middle of a frame
    return RankFailure(reason, "\n".join([head, *lines]) if lines else head)


def earliest_rank_error(attempt_dir: Path) -> str | None:
    """``earliest_failure``'s text only; None if no rank wrote an error file."""
    failure = earliest_failure(attempt_dir)
    return failure.text if failure is not None else None
