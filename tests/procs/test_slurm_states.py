"""The Slurm-state table, sacct parsing, and the launcher's tolerance of a failing sacct.

Pure, except the last tests, which run real (failing) executables in place of sacct.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from service.core.config import Settings
from worker.attempt import ExitCode, FailureReason, write_rank_error
from worker.launchers.base import RunPhase
from worker.launchers.slurm.launcher import SlurmLauncher
from worker.launchers.slurm.states import (
    SLURM_STATE_TO_PHASE,
    UNKNOWN_STATE_FALLBACK,
    SacctRecord,
    parse_job_name,
    parse_sacct,
    phase_of_state,
    sacct_command,
    slurm_job_name,
    status_from_records,
)

# The table, row by row: every state named there must map as it says.
REQUIRED = {
    "PENDING": RunPhase.PENDING,
    "RUNNING": RunPhase.RUNNING,
    "COMPLETED": RunPhase.SUCCEEDED,
    "FAILED": RunPhase.FAILED,
    "NODE_FAIL": RunPhase.FAILED,
    "OUT_OF_MEMORY": RunPhase.FAILED,
    "TIMEOUT": RunPhase.FAILED,
    "CANCELLED": RunPhase.CANCELLED,
    "PREEMPTED": RunPhase.PREEMPTED,
    "REQUEUED": RunPhase.PREEMPTED,
}


@pytest.mark.parametrize(("state", "phase"), sorted(REQUIRED.items()))
def test_required_rows(state: str, phase: RunPhase) -> None:
    assert SLURM_STATE_TO_PHASE[state] == phase
    assert phase_of_state(state) == phase


def test_unknown_states_meet_the_explicit_fallback() -> None:
    assert UNKNOWN_STATE_FALLBACK not in (RunPhase.SUCCEEDED, RunPhase.FAILED)
    assert phase_of_state("SOMETHING_NEW") == UNKNOWN_STATE_FALLBACK


def test_job_name_round_trip() -> None:
    assert parse_job_name(slurm_job_name(12, 3)) == (12, 3)
    assert parse_job_name("submitit") is None
    assert parse_job_name("ddpq-1-x") is None


def test_sacct_command_is_one_call_for_all_jobs() -> None:
    cmd = sacct_command(["12", "3", "12"])
    assert cmd[0] == "sacct" and cmd[-2:] == ["-j", "3,12"]
    assert {"-X", "-D", "-n", "-P"} <= set(cmd)


SACCT_OUTPUT = """\
5|ddpq-1-1|COMPLETED|0:0|None
6|ddpq-2-1|CANCELLED by 0|0:15|None
7|ddpq-3-1|REQUEUED|0:0|None
7|ddpq-3-1|PENDING|0:0|BeginTime
8|ddpq-4-1|FAILED|85:0|NonZeroExitCode
8.batch|batch|FAILED|85:0|
9|ddpq-5-1|OUT_OF_MEMORY|0:125|OutOfMemory
10|ddpq-6-1|FAILED|1:0|NonZeroExitCode
11|ddpq-7-1|FAILED|86:0|NonZeroExitCode
12|ddpq-8-1|TIMEOUT|0:0|TimeLimit
garbage line
"""


def test_parse_sacct() -> None:
    records = parse_sacct(SACCT_OUTPUT)
    assert sorted(records, key=int) == [str(i) for i in range(5, 13)]
    assert records["6"][0].state == "CANCELLED"
    assert records["6"][0].exit_signal == 15
    assert [r.state for r in records["7"]] == ["REQUEUED", "PENDING"]
    assert records["7"][1].reason == "BeginTime" and records["5"][0].reason is None
    assert len(records["8"]) == 1  # the .batch step is not the job


@pytest.mark.parametrize(
    ("job", "phase", "reason_part"),
    [
        ("5", RunPhase.SUCCEEDED, None),
        ("6", RunPhase.CANCELLED, "cancelled"),
        ("7", RunPhase.PREEMPTED, "requeued"),
        ("8", RunPhase.PREEMPTED, "USR1"),
        ("9", RunPhase.FAILED, "out of memory"),
        ("10", RunPhase.FAILED, "exit code 1:0"),
        ("11", RunPhase.FAILED, "time limit"),
        ("12", RunPhase.FAILED, "time limit"),
    ],
)
def test_status_from_records(job: str, phase: RunPhase, reason_part: str | None) -> None:
    status = status_from_records(parse_sacct(SACCT_OUTPUT)[job])
    assert status.phase == phase, status
    if reason_part is not None:
        assert reason_part in (status.reason or ""), status.reason


def test_exit_codes_are_distinct_and_below_128() -> None:
    # Slurm's accounting garbles exit codes above 128; the runtime's own codes are 0, 1, 75.
    codes = {ExitCode.PREEMPTED, ExitCode.TIME_LIMIT}
    assert len(codes) == 2 and max(codes) < 128
    assert not codes & {0, 1, 75}


def test_a_requeue_counts_even_when_the_newest_run_is_running() -> None:
    rec = [
        SacctRecord("7", "ddpq-3-1", "PREEMPTED", 0, 0, None),
        SacctRecord("7", "ddpq-3-1", "RUNNING", 0, 0, None),
    ]
    assert status_from_records(rec).phase == RunPhase.PREEMPTED


def test_no_records_is_an_error() -> None:
    with pytest.raises(ValueError):
        status_from_records([])


# -- a failing sacct (a real process that fails in its place) ----------------------------------


def _launcher(tmp_path: Path, **kw: object) -> SlurmLauncher:
    settings = Settings(database_url=f"sqlite:///{tmp_path}/db.sqlite", artifact_dir=tmp_path / "a")
    return SlurmLauncher(settings, cwd=tmp_path, **kw)  # type: ignore[arg-type]


def test_failed_sacct_keeps_a_fresh_job_pending(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path, sacct="false", missing_grace_s=60.0)
    assert launcher.poll("123").phase == RunPhase.PENDING
    assert launcher.refresh() is False


def test_missing_sacct_binary_is_a_failed_poll_not_a_crash(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    launcher = _launcher(tmp_path, sacct=str(tmp_path / "no-such-sacct"), missing_grace_s=60.0)
    assert launcher.poll("123").phase == RunPhase.PENDING
    # The poll failed (said so, in the log) rather than finding no record of the job.
    assert launcher.refresh() is False
    assert launcher.sacct_calls == 2
    assert any("sacct failed" in r.getMessage() and "no-such-sacct" in r.getMessage()
               for r in caplog.records), caplog.text  # fmt: skip


def test_a_job_sacct_never_lists_fails_after_the_grace_period(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path, sacct="true", missing_grace_s=0.0)
    status = launcher.poll("123")
    assert status.phase == RunPhase.FAILED
    assert "no record" in (status.reason or "")
    assert launcher.poll("123") == status  # stable once ended


def test_polls_within_the_interval_share_one_sacct(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path, sacct="true", poll_interval_s=60.0)
    for handle in ("1", "2", "3", "1", "2", "3"):
        launcher.poll(handle)
    # One call per handle seen for the first time; none for repeats inside the interval.
    assert launcher.sacct_calls == 3
    launcher.poll_many(["1", "2", "3", "4"])
    assert launcher.sacct_calls == 4


def test_rows_of_an_older_job_with_a_reused_id_are_ignored(tmp_path: Path) -> None:
    # A stand-in for sacct at the process boundary: Slurm reused id 5 after losing its state,
    # so sacct lists an older, requeued job 5 before ours.
    fake = tmp_path / "sacct"
    fake.write_text(
        "#!/bin/sh\necho '5|ddpq-9-1|REQUEUED|0:0|None'\necho '5|ddpq-1-1|RUNNING|0:0|None'\n"
    )
    fake.chmod(0o755)
    launcher = _launcher(tmp_path, sacct=str(fake))
    assert launcher.poll("5").phase == RunPhase.RUNNING


def test_every_slurm_failure_carries_a_failure_reason() -> None:
    for state in ("OUT_OF_MEMORY", "TIMEOUT", "NODE_FAIL", "FAILED"):
        status = status_from_records([SacctRecord("9", "ddpq-1-1", state, 1, 0, None)])
        assert status.phase == RunPhase.FAILED and status.failure == FailureReason.ERROR, state
    limit = SacctRecord("9", "ddpq-1-1", "FAILED", int(ExitCode.TIME_LIMIT), 0, None)
    assert status_from_records([limit]).failure == FailureReason.ERROR


@pytest.mark.parametrize("reason", [FailureReason.NONFINITE_LOSS, FailureReason.SETUP])
def test_a_rank_error_files_reason_becomes_the_status_failure(
    tmp_path: Path, reason: FailureReason
) -> None:
    fake = tmp_path / "sacct"  # sacct's stand-in at the process boundary
    fake.write_text("#!/bin/sh\necho '5|ddpq-3-1|FAILED|1:0|None'\n")
    fake.chmod(0o755)
    launcher = _launcher(tmp_path, sacct=str(fake))
    exc = RuntimeError("loss is nan at step 3")
    exc.reason = reason  # type: ignore[attr-defined]
    write_rank_error(launcher.artifact_dir, 3, 1, 0, exc, 1.0)
    status = launcher.poll("5")
    assert status.phase == RunPhase.FAILED and status.failure == reason, status
    assert (status.reason or "").startswith(f"{reason}: "), status.reason
