"""What a failed attempt says, as text for the job's error: the earliest rank's error file
(``error-rank-N.json``, written by ``worker.runtime.outcome``), the tail of a log, an exit
code. Shared by the local and Slurm launchers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from worker.runtime.outcome import REASON_ERROR, REASON_SETUP, REASON_STALLED, error_headline

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


def _rank_errors(attempt_dir: Path) -> Iterator[dict[str, Any]]:
    for path in attempt_dir.glob("error-rank-*.json"):
        try:
            data = json.loads(path.read_text(errors="replace"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            yield data


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
    errors = list(_rank_errors(attempt_dir))
    return bool(errors) and all(
        str(e.get("rank")) != str(rank)
        and any(m in str(e.get("message", "")) for m in PEER_LOST_MARKERS)
        for e in errors
    )


def earliest_rank_error(attempt_dir: Path) -> str | None:
    """The error of the rank that failed first (by its ``time``, then rank), as text:
    ``"rank 1 failed: RuntimeError: boom"`` plus the traceback's last whole frames (a stall:
    the five innermost; a non-finite loss: none); None if no rank wrote an error file."""

    def key(e: dict[str, Any]) -> tuple[float, int]:
        try:
            return float(e.get("time", 0.0)), int(e.get("rank", 0))
        except (TypeError, ValueError):
            return 0.0, 0

    errors = sorted(_rank_errors(attempt_dir), key=key)
    if not errors:
        return None
    e = errors[0]
    head = error_headline(e)  # "rank 1 failed: …", or "stalled: …" / "nonfinite_loss: …"
    # An exception: the traceback's tail. A stall: the innermost frames, where the rank is
    # stuck (all stacks are in its log). A non-finite loss: the headline says it all.
    tails = {
        REASON_ERROR: TRACEBACK_TAIL_LINES,
        REASON_SETUP: TRACEBACK_TAIL_LINES,
        REASON_STALLED: STALL_TAIL_LINES,
    }
    tail = tails.get(e.get("reason", REASON_ERROR), 0)
    lines = str(e.get("traceback") or "").rstrip().splitlines()[-tail:] if tail else []
    while lines and not lines[0].startswith(("  File ", "Traceback")):
        lines.pop(0)  # never start in the middle of a frame
    return "\n".join([head, *lines]) if lines else head
