"""Why Slurm keeps a worker's submitted jobs pending: one ``squeue -o %r`` call for all of
them, parsed into ``{scheduler_job_id: reason code}`` (e.g. ``Resources``, ``Priority``,
``JobHeldUser``; the plain words are ``service.core.pending_reasons``)."""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterable

from service.core.limits import SLURM_COMMAND_TIMEOUT_S

log = logging.getLogger(__name__)

# squeue's output: "<job id>|<reason>" per job (a reason may hold spaces and commas).
SQUEUE_FORMAT = "%i|%r"


def squeue_pending_command(scheduler_job_ids: Iterable[str], squeue: str = "squeue") -> list[str]:
    """The squeue command line that prints the pending reason of each pending job of
    ``scheduler_job_ids`` (jobs no longer pending are left out by ``--states``)."""
    ids = ",".join(sorted(set(scheduler_job_ids)))
    return [squeue, "--noheader", "--states=PENDING", f"--jobs={ids}", "--format", SQUEUE_FORMAT]


def parse_squeue_reasons(text: str) -> dict[str, str]:
    """``{scheduler_job_id: reason}`` from ``squeue_pending_command``'s output; lines that
    are not ``id|reason`` are skipped."""
    reasons: dict[str, str] = {}
    for line in text.splitlines():
        job_id, sep, reason = line.strip().partition("|")
        if sep and job_id and reason.strip():
            reasons[job_id.strip()] = reason.strip()
    return reasons


def query_pending_reasons(scheduler_job_ids: list[str], squeue: str = "squeue") -> dict[str, str]:
    """Slurm's pending reason of every job of ``scheduler_job_ids`` that is still pending, by
    one squeue call; empty when there are none or squeue fails (logged: the reasons are for
    people, the job's state comes from sacct)."""
    if not scheduler_job_ids:
        return {}
    cmd = squeue_pending_command(scheduler_job_ids, squeue)
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=SLURM_COMMAND_TIMEOUT_S, check=True
        )
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("squeue failed (%s); pending reasons not refreshed",
                    getattr(exc, "stderr", None) or exc)  # fmt: skip
        return {}
    return parse_squeue_reasons(done.stdout)
