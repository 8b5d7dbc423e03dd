"""What a failed attempt says: the earliest rank's error file (``error-rank-N.json``, written
by ``worker.attempt.write_rank_error``) as the job's error text plus its ``FailureReason``,
the tail of a log, an exit code. Shared by the local and Slurm launchers."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.core.artifacts import finished_ranks
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


# torchrun's failure summary: one entry per failed rank it observed ("rank : 1 (local_rank: 1)"
# then "exitcode : -9 (pid: …) (SIGKILL)"), the first observed one under "Root Cause".
ROOT_CAUSE_RE = re.compile(
    r"Root Cause.*?rank\s*:\s*(?P<rank>\d+).*?exitcode\s*:\s*(?P<exitcode>-?\d+)", re.S
)
FAILURE_ENTRY_RE = re.compile(
    r"rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:[^)]*\)\s*\n\s*exitcode\s*:\s*(?P<exitcode>-?\d+)"
)
# The warm agent's own line per rank once one failed (worker.runtime.agent): its summary names
# one rank only, the first one torch's process context happened to find dead.
AGENT_EXIT_RE = re.compile(
    r"^ddpq agent: rank (?P<rank>\d+) exitcode (?P<exitcode>-?\d+)\s*$", re.M
)


@dataclass(frozen=True)
class LauncherExits:
    """What torchrun's agent said about the ranks in ``launcher.log``: the rank its summary
    names as root cause (None without a summary) and every exit code it reported
    (``{rank: exitcode}``, negative for a signal; ranks it never reported are absent)."""

    root_rank: int | None
    exit_codes: Mapping[int, int]

    @classmethod
    def parse(cls, log_text: str) -> LauncherExits:
        """Read torchrun's failure summary and the agent's exit-code lines from log text."""
        codes: dict[int, int] = {}
        for regex in (FAILURE_ENTRY_RE, AGENT_EXIT_RE):
            for m in regex.finditer(log_text):
                codes[int(m["rank"])] = int(m["exitcode"])
        cause = ROOT_CAUSE_RE.search(log_text)
        if cause is not None:
            codes.setdefault(int(cause["rank"]), int(cause["exitcode"]))
        return cls(int(cause["rank"]) if cause is not None else None, codes)


def is_peer_lost(error: Mapping[str, Any]) -> bool:
    """Whether a rank's error only says that a peer went away (``PEER_LOST_MARKERS``)."""
    return any(m in str(error.get("message", "")) for m in PEER_LOST_MARKERS)


def silent_culprit(attempt_dir: Path, exits: LauncherExits) -> tuple[int, int] | None:
    """The rank that caused the failure without writing an error report, with its exit code.

    A rank that exited non-zero without an error file (killed by a signal, or ``sys.exit`` /
    ``os._exit`` in user code) is the cause when every error file of the attempt only says a
    peer went away: those are its symptoms, whatever order they were written in and whichever
    rank torchrun names. Any other error file (a real exception) wins over silent ranks: those
    may be peers killed in the teardown after it. Among silent ranks: the one torchrun names,
    then one killed by a signal, then the lowest rank.

    Returns:
        ``(rank, exitcode)``, or None when some rank reported a real error or no silent
        failed rank is known.
    """
    errors = list(read_rank_errors(attempt_dir))
    if not all(is_peer_lost(e) for e in errors):
        return None
    wrote = {str(e.get("rank")) for e in errors}
    # A rank whose code had returned left its loop on its own: torchrun's SIGTERM found it
    # on its way out, so its signal exit is the teardown's, not the cause.
    finished = set(finished_ranks(attempt_dir)) if errors else set()
    silent = [
        (r, c)
        for r, c in exits.exit_codes.items()
        if c != 0 and str(r) not in wrote and r not in finished
    ]
    if not silent:
        return None
    return min(silent, key=lambda rc: (rc[0] != exits.root_rank, rc[1] >= 0, rc[0]))


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


def attempt_failure(
    attempt_dir: Path, launcher_log: Path, rank_log: Callable[[int], Path], rc: int
) -> RankFailure:
    """Which rank a failed attempt blames and why.

    A rank that died without an error report while the others' errors only say it went away
    (``silent_culprit``, from ``launcher_log``'s exit codes); else the earliest rank error
    (with its reason); else the rank torchrun names as root cause, with the tail of that rank's
    log (``rank_log(rank)``); else torchrun's exit code ``rc`` and the tail of ``launcher_log``
    (both ``FailureReason.ERROR``: no rank said why).
    """
    exits = LauncherExits.parse(tail_lines(launcher_log, n=400, max_bytes=256_000))
    culprit = silent_culprit(attempt_dir, exits)
    error = earliest_failure(attempt_dir)
    if error is not None and culprit is None:
        return _with_finished_peers(error, attempt_dir)
    head, log_path = f"torchrun {describe_exit(rc)}", launcher_log
    if culprit is not None:
        rank, code = culprit
        head = f"rank {rank} {describe_exit(code)} without an error report"
        log_path = rank_log(rank) if rank_log(rank).exists() else launcher_log
    return RankFailure(FailureReason.ERROR, f"{head}; last lines of {log_path.name}:\n"
                       f"{tail_lines(log_path)}")  # fmt: skip


def _with_finished_peers(error: RankFailure, attempt_dir: Path) -> RankFailure:
    """``error`` with a line naming the ranks whose code had already returned, when the
    error only says a peer went away: the usual cause is uneven inputs (ranks running a
    different number of steps), which torch's ``Join`` context manager handles."""
    finished = finished_ranks(attempt_dir)
    if not finished or not any(is_peer_lost(e) for e in read_rank_errors(attempt_dir)):
        return error
    names = ", ".join(str(r) for r in finished)
    which = "rank" if len(finished) == 1 else "ranks"
    head, _, rest = error.text.partition("\n")
    note = (
        f"{which} {names} had already left its training code while this rank still called "
        "collectives (uneven inputs? see torch.distributed.algorithms.Join)"
    )
    return RankFailure(error.reason, "\n".join(p for p in (head, note, rest) if p))
