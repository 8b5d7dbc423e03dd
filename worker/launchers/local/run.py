"""One attempt the local launcher started, and how it ends: stopping it (SIGTERM, the wait
for a stop checkpoint's upload, SIGKILL) and reading its outcome (rank 0's ``result.json``,
else the earliest failing rank). ``worker.launchers.local.launcher`` starts and polls; this module
owns what happens to a started run.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from service.core import artifacts
from service.core.events import EventKind
from worker.attempt import STOP_UPLOAD_S, FailureReason, read_rank_errors, stop_upload_marker
from worker.launchers.base import LaunchPlan, RunPhase, RunStatus
from worker.launchers.failure_text import attempt_failure, is_peer_lost
from worker.launchers.local.attempt_logs import AttemptLogs
from worker.launchers.local.capped_log import SETTING as LOG_CAP_SETTING
from worker.launchers.local.cgroups import JobCgroup
from worker.launchers.local.process_groups import kill_attempt, term_and_wait
from worker.launchers.local.process_limits import limit_hint
from worker.processes import find_tagged_processes

log = logging.getLogger(__name__)

# Seconds an attempt may linger when every error file only says a peer went away: the rank
# that died wrote nothing, and torchrun's agent, which sees it die, must get to write its exit
# summary (the dead rank and its signal) before we kill it, or the survivor gets the blame.
PEER_LOST_GRACE_S = 20.0


@dataclass
class LocalRun:
    """One started attempt: its plan, torchrun's process, and what we did to it."""

    plan: LaunchPlan
    popen: subprocess.Popen[bytes]
    logs: AttemptLogs
    cgroup: JobCgroup | None
    tags: frozenset[bytes]
    started_mono: float
    timeout_s: float | None
    started_fs_ns: int  # launcher.log's creation mtime: the file system's clock at start
    cancelled: bool = False
    timed_out: bool = False
    result_seen_mono: float | None = None
    error_seen_mono: float | None = None
    final: RunStatus | None = None
    limit_hit: str | None = None  # the cgroup's limit the attempt hit, as a sentence


def has_result(run: LocalRun, artifact_dir: Path) -> bool:
    """Whether rank 0 wrote this attempt's result.json (one older than the attempt's start
    is someone else's and does not count)."""
    path = artifacts.result_path(artifact_dir, run.plan.job_id, run.plan.attempt)
    try:
        return path.stat().st_mtime_ns >= run.started_fs_ns
    except OSError:
        return False


def failure_known(run: LocalRun, now: float, grace_s: float) -> bool:
    """Whether a rank wrote an error file at least ``grace_s`` seconds ago (by our clock:
    first seen by a poll), or ``PEER_LOST_GRACE_S`` when every error file only says a peer
    went away. Never while the worker is cancelling the attempt."""
    if run.error_seen_mono is None:
        if run.cancelled or not artifacts.rank_error_files(Path(run.plan.log_dir)):
            return False
        run.error_seen_mono = now
    waited_s = now - run.error_seen_mono
    if waited_s < grace_s:
        return False
    if waited_s >= PEER_LOST_GRACE_S:
        return True
    return not all(is_peer_lost(e) for e in read_rank_errors(Path(run.plan.log_dir)))


def terminate(
    run: LocalRun, artifact_dir: Path, *, grace_s: float, upload_wait: bool = True
) -> None:
    """SIGTERM the attempt, SIGKILL what is left after ``grace_s`` seconds, or (with
    ``upload_wait``) up to ``STOP_UPLOAD_S`` later while rank 0 still uploads its stop
    checkpoint (its marker file, ``stop_upload_marker``: the checkpoint must reach the API
    before it exits)."""
    term_and_wait(run.popen, run.tags, grace_s)
    marker = stop_upload_marker(artifact_dir, run.plan.job_id, run.plan.attempt)
    deadline = time.monotonic() + (STOP_UPLOAD_S if upload_wait else 0.0)
    while marker.exists() and time.monotonic() < deadline:
        if run.popen.poll() is not None and not find_tagged_processes(run.tags):
            break
        time.sleep(0.1)
    kill_leftovers(run)


def kill_leftovers(run: LocalRun) -> None:
    """SIGKILL whatever is left of the attempt and reap torchrun, write the rest of its
    output into its logs, and remove its cgroup (after noting a limit it hit)."""
    survivors = kill_attempt(run.popen, run.tags)
    run.logs.close()
    if run.cgroup is not None:
        run.limit_hit = run.limit_hit or run.cgroup.limit_hit()
        run.cgroup.remove()
    for pid in survivors:
        log.error("job_id=%d attempt=%d: process %d survived SIGKILL",
                  run.plan.job_id, run.plan.attempt, pid)  # fmt: skip


def finish(run: LocalRun, artifact_dir: Path) -> RunStatus:
    """Reap the ended attempt (and anything left of it) and decide its outcome, kept as
    ``run.final``: success by rank 0's result.json, else cancelled, timed out, or the
    earliest failing rank's reason (else torchrun's exit code and its log's tail)."""
    rc = run.popen.wait()
    kill_leftovers(run)
    if has_result(run, artifact_dir):
        status = RunStatus(RunPhase.SUCCEEDED, None, rc)
    elif run.cancelled:
        status = RunStatus(RunPhase.CANCELLED, "cancelled", rc)
    elif run.timed_out:
        minutes = (run.timeout_s or 0) / 60
        status = RunStatus(
            RunPhase.FAILED,
            f"timed out after {minutes:g} min (resources.timeout_min)",
            rc,
            failure=FailureReason.ERROR,
        )
    else:
        job_id, attempt = run.plan.job_id, run.plan.attempt
        failure = attempt_failure(
            Path(run.plan.log_dir),
            artifacts.launcher_log_path(artifact_dir, job_id, attempt),
            lambda rank: artifacts.rank_log_path(artifact_dir, job_id, attempt, rank),
            rc,
        )
        hint = run.limit_hit or limit_hint(failure.text)
        text = failure.text if hint is None else f"{failure.text} ({hint})"
        status = RunStatus(RunPhase.FAILED, text, rc, failure=failure.reason)
    status = replace(status, notes=log_cut_notes(run.logs))
    run.final = status
    return status


def log_cut_notes(logs: AttemptLogs) -> tuple[tuple[EventKind, Mapping[str, Any]], ...]:
    """One ``quota_exceeded`` note per log of the attempt that was cut at its cap: the bytes
    written to it (``asked``), the cap (``limit``) and the setting to raise."""
    notes: list[tuple[EventKind, Mapping[str, Any]]] = []
    for name, cut in sorted(logs.cut_bytes.items()):
        data = {
            "quota": f"log {name}",
            "limit": logs.cap_bytes,
            "asked": logs.cap_bytes + cut,
            "setting": LOG_CAP_SETTING,
            "unit": "bytes",
        }
        notes.append((EventKind.QUOTA_EXCEEDED, data))
    return tuple(notes)
