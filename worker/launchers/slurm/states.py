"""The one table from Slurm job states to launcher phases, and parsing of ``sacct`` output.

Everything here is pure: text in, values out. ``SlurmLauncher.poll`` adds what only the
artifact directory knows (result.json decides success; a rank's error file names the failure).
"""

from __future__ import annotations

import logging
import re
import signal
from collections.abc import Iterable
from dataclasses import dataclass

from worker.attempt import ExitCode, FailureReason
from worker.launchers.base import RunPhase, RunStatus

log = logging.getLogger(__name__)

# Slurm's job states (squeue/sacct long names) → what the launcher reports. Adding a state
# means adding a row here and to its test; anything not listed meets UNKNOWN_STATE_FALLBACK.
SLURM_STATE_TO_PHASE: dict[str, RunPhase] = {
    # Waiting for or setting up an allocation: ddpq shows the job as `starting`.
    "PENDING": RunPhase.PENDING,
    "CONFIGURING": RunPhase.PENDING,
    "RESIZING": RunPhase.PENDING,
    "REQUEUE_FED": RunPhase.PENDING,
    # Ranks exist (or are being torn down after running).
    "RUNNING": RunPhase.RUNNING,
    "COMPLETING": RunPhase.RUNNING,
    "SIGNALING": RunPhase.RUNNING,
    "STAGE_OUT": RunPhase.RUNNING,
    "SUSPENDED": RunPhase.RUNNING,
    "STOPPED": RunPhase.RUNNING,
    # Ended.
    "COMPLETED": RunPhase.SUCCEEDED,
    "FAILED": RunPhase.FAILED,
    "NODE_FAIL": RunPhase.FAILED,
    "OUT_OF_MEMORY": RunPhase.FAILED,
    "TIMEOUT": RunPhase.FAILED,
    "BOOT_FAIL": RunPhase.FAILED,
    "DEADLINE": RunPhase.FAILED,
    "SPECIAL_EXIT": RunPhase.FAILED,
    "REVOKED": RunPhase.CANCELLED,
    "CANCELLED": RunPhase.CANCELLED,
    # Slurm took the allocation away: relaunch without counting against max_restarts.
    "PREEMPTED": RunPhase.PREEMPTED,
    "REQUEUED": RunPhase.PREEMPTED,
    "REQUEUE_HOLD": RunPhase.PREEMPTED,
    "RESV_DEL_HOLD": RunPhase.PREEMPTED,
}

# A state this table does not know (a newer Slurm, a site plugin) keeps the attempt where it
# was last seen: never a terminal guess that would kill or fail a healthy job. The worker's own
# limits (timeout_min, cancel) still end it; the state is logged once per poll as a warning.
UNKNOWN_STATE_FALLBACK = RunPhase.PENDING

# Why an attempt failed, for the states that say more than "failed".
FAILURE_REASONS: dict[str, str] = {
    "TIMEOUT": "Slurm time limit reached (TIMEOUT)",
    "OUT_OF_MEMORY": "out of memory (Slurm OUT_OF_MEMORY): raise resources.mem_gb",
    "NODE_FAIL": "a node of the allocation failed (Slurm NODE_FAIL)",
    "BOOT_FAIL": "a node failed to boot (Slurm BOOT_FAIL)",
    "DEADLINE": "Slurm deadline reached (DEADLINE)",
}

# Slurm's warning signal. The runtime stops on it at the next step, checkpoints and returns
# ``signal_exit(PREEMPT_SIGNAL)``; the Slurm task turns that into ``ExitCode.PREEMPTED``
# (Slurm garbles exit codes above 128 in its accounting: a task's 138 shows as "10:0"), which
# poll reports as PREEMPTED, or ``ExitCode.TIME_LIMIT`` when the time limit is near (the ranks
# checkpointed, but the job failed its limit; relaunching would only hit it again).
PREEMPT_SIGNAL = signal.SIGUSR1

# Fields asked of sacct, in this order (``--parsable2 --noheader``). JobID, not JobIDRaw: an
# array element is ``<array job id>_<index>`` there (its handle), and the elements still
# pending are one row, ``<array job id>_[2-7%2]``.
SACCT_FIELDS = ("JobID", "JobName", "State", "ExitCode", "Reason")
ARRAY_RANGE_RE = re.compile(r"^(?P<array>\d+)_\[(?P<ranges>[\d,\-]+)(?:%\d+)?\]$")

JOB_NAME_RE = re.compile(r"^ddpq-(?P<job_id>\d+)-(?P<attempt>\d+)$")
ARRAY_NAME_RE = re.compile(r"^ddpq-array-(?P<job_id>\d+)-(?P<attempt>\d+)$")


def slurm_job_name(job_id: int, attempt: int) -> str:
    """The Slurm job name of one attempt, ``ddpq-<job_id>-<attempt>``: sacct gives it back, so a
    restarted worker knows which ddpq attempt a Slurm job id belongs to."""
    return f"ddpq-{int(job_id)}-{int(attempt)}"


def parse_job_name(name: str) -> tuple[int, int] | None:
    """``(job_id, attempt)`` from a name made by ``slurm_job_name``; None for any other name."""
    m = JOB_NAME_RE.match(name)
    return (int(m["job_id"]), int(m["attempt"])) if m else None


def slurm_array_name(first_job_id: int, first_attempt: int) -> str:
    """The Slurm job name of a job array, ``ddpq-array-<job_id>-<attempt>`` after its element
    0: unique (an attempt is started once), and it names the array's folder, whose manifest
    says which ddpq attempt each element runs (``worker.launchers.slurm.array``)."""
    return f"ddpq-array-{int(first_job_id)}-{int(first_attempt)}"


def parse_array_name(name: str) -> tuple[int, int] | None:
    """``(job_id, attempt)`` of element 0 from a name made by ``slurm_array_name``; else None."""
    m = ARRAY_NAME_RE.match(name)
    return (int(m["job_id"]), int(m["attempt"])) if m else None


@dataclass(frozen=True)
class SacctRecord:
    """One allocation row of sacct (``-X``); a requeued job has one row per run (``-D``)."""

    scheduler_job_id: str
    job_name: str
    state: str  # first word of sacct's State: "CANCELLED by 0" → "CANCELLED"
    exit_code: int | None
    exit_signal: int | None
    reason: str | None


def sacct_query_id(scheduler_job_id: str) -> str:
    """What sacct is asked for to see ``scheduler_job_id``: an array element (``123_4``) by its
    array (``123``), since sacct lists nothing for an element still pending in the array's
    range; any other id as it is."""
    array, sep, index = scheduler_job_id.partition("_")
    return array if sep and array.isdigit() and index.isdigit() else scheduler_job_id


def expand_job_ids(sacct_job_id: str) -> list[str]:
    """The job ids one sacct row stands for: an array's pending range (``123_[2-4,7%2]``) →
    ``["123_2", "123_3", "123_4", "123_7"]``; any other id → itself."""
    m = ARRAY_RANGE_RE.match(sacct_job_id)
    if m is None:
        return [sacct_job_id]
    ids: list[str] = []
    for part in m["ranges"].split(","):
        first, _, last = part.partition("-")
        if first.isdigit() and (not last or last.isdigit()):
            ids += [f"{m['array']}_{i}" for i in range(int(first), int(last or first) + 1)]
    return ids


def sacct_command(scheduler_job_ids: Iterable[str]) -> list[str]:
    """One sacct call for all ``scheduler_job_ids``: allocations only (``-X``), every run of a
    requeued job (``-D``), machine-readable (``-n -P``); array elements by their array
    (``sacct_query_id``), so one array costs one id in one call."""
    ids = ",".join(sorted({sacct_query_id(i) for i in scheduler_job_ids}, key=_id_order))
    return ["sacct", "-n", "-P", "-X", "-D", "-o", ",".join(SACCT_FIELDS), "-j", ids]


def _id_order(job_id: str) -> tuple[int, str]:
    return (int(job_id), "") if job_id.isdigit() else (-1, job_id)


def _exit_code(raw: str) -> tuple[int | None, int | None]:
    code, _, sig = raw.partition(":")
    try:
        return int(code), int(sig or 0)
    except ValueError:
        return None, None


def parse_sacct(text: str) -> dict[str, list[SacctRecord]]:
    """sacct's ``-n -P -o SACCT_FIELDS`` output → records per Slurm job id, oldest run first;
    an array's pending range gives each of its elements the range's record.

    Lines that are not ``len(SACCT_FIELDS)`` fields, or are job steps (``123.batch``), are
    skipped.
    """
    records: dict[str, list[SacctRecord]] = {}
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) != len(SACCT_FIELDS) or not parts[0] or "." in parts[0]:
            continue
        raw_id, name, state, exit_raw, reason = (p.strip() for p in parts)
        code, sig = _exit_code(exit_raw)
        for job_id in expand_job_ids(raw_id):
            records.setdefault(job_id, []).append(
                SacctRecord(
                    scheduler_job_id=job_id,
                    job_name=name,
                    state=state.split(" ")[0].rstrip("+") if state else "UNKNOWN",
                    exit_code=code,
                    exit_signal=sig,
                    reason=None if reason in ("", "None") else reason,
                )
            )
    return records


def phase_of_state(state: str) -> RunPhase:
    """The table lookup with its explicit fallback for states it does not know."""
    phase = SLURM_STATE_TO_PHASE.get(state)
    if phase is None:
        log.warning("unknown Slurm state %r: treated as %s", state, UNKNOWN_STATE_FALLBACK)
        return UNKNOWN_STATE_FALLBACK
    return phase


def status_from_records(records: list[SacctRecord]) -> RunStatus:
    """What sacct's rows for one Slurm job say about the ddpq attempt it runs.

    An earlier run that Slurm requeued or preempted means the attempt was preempted, whatever
    the newest run shows (the launcher cancels that copy; ddpq relaunches as attempt + 1).
    A ``FAILED`` run whose exit code is ``ExitCode.PREEMPTED`` stopped on Slurm's warning
    signal after checkpointing: preempted as well. Every failure carries
    ``FailureReason.ERROR`` (the launcher replaces it with a rank's error file's reason).

    Raises:
        ValueError: ``records`` is empty.
    """
    if not records:
        raise ValueError("no sacct records")
    for earlier in records:
        if SLURM_STATE_TO_PHASE.get(earlier.state) == RunPhase.PREEMPTED:
            return RunStatus(
                RunPhase.PREEMPTED,
                reason=f"Slurm job {earlier.scheduler_job_id} was {earlier.state.lower()}",
            )
    last = records[-1]
    phase = phase_of_state(last.state)
    if phase == RunPhase.FAILED and last.exit_code == ExitCode.PREEMPTED:
        return RunStatus(
            RunPhase.PREEMPTED,
            reason=f"ranks checkpointed and stopped on Slurm's warning signal "
            f"({PREEMPT_SIGNAL.name})",
            exit_code=last.exit_code,
        )
    if phase == RunPhase.FAILED and last.exit_code == ExitCode.TIME_LIMIT:
        return RunStatus(
            phase,
            reason="Slurm time limit reached (ranks checkpointed on the warning signal first)",
            exit_code=last.exit_code,
            failure=FailureReason.ERROR,
        )
    if phase == RunPhase.FAILED:
        why = FAILURE_REASONS.get(last.state) or (
            f"Slurm job {last.scheduler_job_id} {last.state} "
            f"(exit code {last.exit_code}:{last.exit_signal})"
        )
        if last.reason:
            why += f"; Slurm reason: {last.reason}"
        return RunStatus(phase, reason=why, exit_code=last.exit_code, failure=FailureReason.ERROR)
    if phase == RunPhase.CANCELLED:
        return RunStatus(phase, reason=f"Slurm job {last.scheduler_job_id} cancelled")
    if phase == RunPhase.SUCCEEDED:
        return RunStatus(phase, exit_code=last.exit_code)
    return RunStatus(phase)
