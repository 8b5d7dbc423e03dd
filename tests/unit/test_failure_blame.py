"""Which rank a failed attempt blames, from fabricated attempt directories: error files (in
either order of writing) and launcher.log failure summaries (torchrun's, and the warm agent's
exit-code lines) naming either rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.core.artifacts import rank_finished_name
from worker.launchers.failure_text import (
    LauncherExits,
    attempt_failure,
    earliest_failure,
    silent_culprit,
)

PEER_LOST = "[pair.cc:534] Connection closed by peer [127.0.0.1]:4242"


def summary(root: tuple[int, int], *others: tuple[int, int]) -> str:
    """torchrun's failure summary, as ``torch.distributed.elastic`` formats it."""

    def entry(rank: int, code: int) -> str:
        signal = " (SIGKILL)" if code == -9 else ""
        return (
            f"[0]:\n  time      : 2026-12-01_16:00:00\n  host      : box\n"
            f"  rank      : {rank} (local_rank: {rank})\n"
            f"  exitcode  : {code} (pid: 1{rank}){signal}\n"
            f"  error_file: <N/A>\n  traceback : x"
        )

    failures = "\n".join(entry(*o) for o in others) or "  <NO_OTHER_FAILURES>"
    return (
        f"====\nrun FAILED\n----\nFailures:\n{failures}\n----\n"
        f"Root Cause (first observed failure):\n{entry(*root)}\n===="
    )


def write_error(attempt_dir: Path, rank: int, message: str, at_s: float) -> None:
    payload = {"rank": rank, "reason": "error", "exc_type": "RuntimeError",
               "message": message, "traceback": "", "time": at_s}  # fmt: skip
    (attempt_dir / f"error-rank-{rank}.json").write_text(json.dumps(payload))


# What launcher.log may say after rank 1 was SIGKILLed and rank 0's collective failed.
LOGS = {
    "summary names rank 1": summary((1, -9)),
    "summary names rank 0 only (warm agent), agent lines": summary((0, 1))
    + "\nddpq agent: rank 0 exitcode 1\nddpq agent: rank 1 exitcode -9\n",
    "summary names rank 0, rank 1 among the others": summary((0, 1), (1, -9)),
    "agent lines only (torchrun killed before its summary)": (
        "ddpq agent: rank 1 exitcode -9\nddpq agent: rank 0 exitcode 1\n"
    ),
}


@pytest.mark.parametrize("log_text", LOGS.values(), ids=list(LOGS))
@pytest.mark.parametrize("rank0_first", [True, False], ids=["rank0-first", "rank0-later"])
def test_a_rank_killed_by_a_signal_is_blamed_over_the_peer_that_saw_it_go(
    tmp_path: Path, log_text: str, rank0_first: bool
) -> None:
    write_error(
        tmp_path, 0, f"gloo all_reduce failed: {PEER_LOST}", 100.0 if rank0_first else 200.0
    )
    culprit = silent_culprit(tmp_path, LauncherExits.parse(log_text))
    assert culprit == (1, -9), (
        f"expected rank 1 (SIGKILL, no error file) blamed over rank 0's peer-lost error, got "
        f"{culprit} from:\n{log_text}"
    )


@pytest.mark.parametrize("log_text", LOGS.values(), ids=list(LOGS))
def test_a_real_error_wins_over_ranks_killed_in_the_teardown(tmp_path: Path, log_text: str) -> None:
    write_error(tmp_path, 0, "boom at step 5", 100.0)
    assert silent_culprit(tmp_path, LauncherExits.parse(log_text)) is None
    failure = earliest_failure(tmp_path)
    assert failure is not None and failure.text.startswith("rank 0 failed: RuntimeError: boom")


def test_several_peer_lost_reports_still_blame_the_silent_rank(tmp_path: Path) -> None:
    for rank, at_s in ((0, 5.0), (2, 1.0)):
        write_error(tmp_path, rank, PEER_LOST, at_s)
    exits = LauncherExits.parse(summary((2, 1), (0, 1), (1, -9), (3, 143)))
    assert silent_culprit(tmp_path, exits) == (1, -9)


def test_without_error_files_torchruns_root_cause_is_kept(tmp_path: Path) -> None:
    exits = LauncherExits.parse(summary((1, 3), (0, -9)))
    assert exits.root_rank == 1
    assert silent_culprit(tmp_path, exits) == (1, 3)


def test_nothing_known_blames_no_one(tmp_path: Path) -> None:
    write_error(tmp_path, 0, PEER_LOST, 1.0)
    assert silent_culprit(tmp_path, LauncherExits.parse("no summary here")) is None


def test_a_rank_whose_code_had_returned_is_not_blamed_for_its_teardown_sigterm(
    tmp_path: Path,
) -> None:
    """Uneven inputs without DDP's Join: rank 1 leaves its loop and returns, rank 0's next
    all_reduce fails with "Connection closed by peer", torchrun SIGTERMs rank 1 on its way
    out. Rank 0's error is the one told, with a line saying rank 1 had already left."""
    write_error(tmp_path, 0, f"gloo all_reduce failed: {PEER_LOST}", 100.0)
    launcher_log = tmp_path / "launcher.log"
    launcher_log.write_text(summary((1, -15), (0, 1)))
    assert silent_culprit(tmp_path, LauncherExits.parse(launcher_log.read_text())) == (1, -15)
    (tmp_path / rank_finished_name(1)).touch()  # what mark_finished leaves
    assert silent_culprit(tmp_path, LauncherExits.parse(launcher_log.read_text())) is None
    failure = attempt_failure(tmp_path, launcher_log, lambda r: tmp_path / f"rank-{r}.log", 1)
    head, note = failure.text.splitlines()[:2]
    assert head.startswith("rank 0 failed: RuntimeError: gloo all_reduce failed"), failure.text
    assert note.startswith("rank 1 had already left its training code"), failure.text
    assert "Join" in note
