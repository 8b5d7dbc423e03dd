"""What the Slurm cluster says about itself: its ``MaxArraySize`` (``scontrol show config``),
what its partitions' nodes offer (``sinfo``, for error messages), and the message for a
refused submission; and ``scancel``.

The parsers are pure; the two readers run one short command each and never raise.
"""

from __future__ import annotations

import logging
import re
import subprocess
from typing import Any

from service.core.limits import SLURM_COMMAND_TIMEOUT_S

log = logging.getLogger(__name__)

# Slurm's own default, used when scontrol cannot tell (a site that set less gets sbatch's
# refusal as the launch error, which names the limit).
DEFAULT_MAX_ARRAY_SIZE = 1001
MAX_ARRAY_SIZE_RE = re.compile(r"^\s*MaxArraySize\s*=\s*(\d+)\s*$", re.MULTILINE)
# The sbatch parameters a refusal message repeats (submitit's names).
ASKED_PARAMETERS = ("partition", "nodes", "ntasks_per_node", "cpus_per_task", "gpus_per_node",
                    "mem", "time")  # fmt: skip


def parse_max_array_size(scontrol_config: str) -> int | None:
    """``MaxArraySize`` from ``scontrol show config`` output; None when it is not there.

    Slurm allows array indices ``0 … MaxArraySize - 1``, so an array has at most
    ``MaxArraySize`` elements; 0 means arrays are disabled.
    """
    m = MAX_ARRAY_SIZE_RE.search(scontrol_config)
    return int(m.group(1)) if m else None


def read_max_array_size(scontrol: str = "scontrol") -> int:
    """The cluster's ``MaxArraySize`` (one ``scontrol show config``); Slurm's default
    (``DEFAULT_MAX_ARRAY_SIZE``) when scontrol fails or does not say, with a warning."""
    try:
        out = subprocess.run(
            [scontrol, "show", "config"],
            capture_output=True, text=True, timeout=SLURM_COMMAND_TIMEOUT_S, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("scontrol show config failed (%s); assuming MaxArraySize=%d",
                    exc, DEFAULT_MAX_ARRAY_SIZE)  # fmt: skip
        return DEFAULT_MAX_ARRAY_SIZE
    size = parse_max_array_size(out)
    if size is None:
        log.warning("scontrol show config names no MaxArraySize; assuming %d",
                    DEFAULT_MAX_ARRAY_SIZE)  # fmt: skip
        return DEFAULT_MAX_ARRAY_SIZE
    return size


def array_chunks(n: int, max_array_size: int) -> list[range]:
    """Split ``n`` elements (in order) into job arrays Slurm accepts: each at most
    ``max_array_size`` elements (indices ``0 … max_array_size - 1``). Pure.

    ``array_chunks(5, 2)`` → ``[range(0, 2), range(2, 4), range(4, 5)]``.

    Raises:
        ValueError: ``max_array_size`` < 1 (arrays disabled: MaxArraySize=0).
    """
    if max_array_size < 1:
        raise ValueError(
            f"job arrays are disabled on this cluster (MaxArraySize={max_array_size}): "
            "set MaxArraySize in slurm.conf, or run sweeps on the local launcher"
        )
    return [range(i, min(n, i + max_array_size)) for i in range(0, n, max_array_size)]


def refusal_message(params: dict[str, Any], exc: BaseException) -> str:
    """Why sbatch refused a submission, with what it asked for and what the nodes offer."""
    lines = [ln.strip() for ln in str(exc).splitlines() if "error" in ln.lower()]
    message = lines[-1] if lines else (str(exc).strip().splitlines() or [repr(exc)])[-1]
    asked = ", ".join(f"{k}={params[k]}" for k in ASKED_PARAMETERS if k in params)
    return f"sbatch refused the job: {message} (asked for {asked}; {describe_nodes()})"


def describe_nodes() -> str:
    """What the partitions' nodes offer, from sinfo (for error messages)."""
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%P %D %c %m %G"],
            capture_output=True, text=True, timeout=SLURM_COMMAND_TIMEOUT_S, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "sinfo unavailable"
    parts = []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) == 5:
            p, n, cpus, mem, gres = fields
            parts.append(f"partition {p}: {n} node(s) × {cpus} CPUs, {mem} MB, gres {gres}")
    return "; ".join(parts) or "sinfo shows no partition"


def scancel(scheduler_job_id: str) -> None:
    """``scancel`` one Slurm job or array element (``123_4``: that element only); a failure
    is logged, not raised (cancel is retried by its callers, and idempotent)."""
    try:
        done = subprocess.run(
            ["scancel", scheduler_job_id],
            capture_output=True, text=True, timeout=SLURM_COMMAND_TIMEOUT_S,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("scancel %s failed: %s", scheduler_job_id, exc)
        return
    if done.returncode != 0:
        log.info("scancel %s: %s", scheduler_job_id, done.stderr.strip())
