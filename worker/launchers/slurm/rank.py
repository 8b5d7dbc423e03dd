"""What runs inside every Slurm task: torch.distributed's variables from Slurm's, then one rank.

The Slurm launcher submits a ``SlurmRank`` through submitit; ``srun`` starts one task per rank
and each task calls it. It turns Slurm's topology (``SLURM_PROCID``, ``SLURM_LOCALID``,
``SLURM_NTASKS``, ``SLURM_JOB_NUM_NODES``, ``SLURM_JOB_NODELIST``, ``SLURM_JOB_ID``) into
torch's env:// variables, adds ddpq's own, runs ``worker.runtime.main.run_rank`` and ends the
process with the rank's exit code at once (``worker.processes.exit_now``): everything that
matters was flushed by then, and skipping interpreter teardown avoids gloo's abort at exit
after a good run.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field

from worker import attempt
from worker.attempt import ExitCode, signal_exit
from worker.launchers.slurm.states import PREEMPT_SIGNAL
from worker.launchers.slurm.submitit_adapter import parse_node_list
from worker.processes import exit_now

log = logging.getLogger(__name__)

# Master ports are derived from the Slurm job id, in a band below Linux's ephemeral range
# (32768-60999) so an outgoing connection never holds one: two jobs that share a node get
# different ports unless their ids differ by a multiple of MASTER_PORT_SPAN.
MASTER_PORT_BASE = 15000
MASTER_PORT_SPAN = 15000
SCONTROL_TIMEOUT_S = 20.0
# The warning signal counts as "time limit" when less than this is left (seconds): the launcher
# asks for the warning DEFAULT_SIGNAL_DELAY_S (60 s) ahead, plus slack for the step and
# checkpoint the ranks finish first.
TIME_LIMIT_MARGIN_S = 180.0


class SlurmTopologyError(RuntimeError):
    """A Slurm variable the rank needs is missing or malformed (not run under srun?)."""


def master_port_for(scheduler_job_id: str) -> int:
    """The rendezvous port of a Slurm job: ``MASTER_PORT_BASE + id % MASTER_PORT_SPAN``.

    Array or het-job ids (``123_4``, ``123+1``) use their leading number.
    """
    digits = ""
    for ch in scheduler_job_id:
        if not ch.isdigit():
            break
        digits += ch
    if not digits:
        raise SlurmTopologyError(f"SLURM_JOB_ID={scheduler_job_id!r} is not a job id")
    return MASTER_PORT_BASE + int(digits) % MASTER_PORT_SPAN


def first_node(nodelist: str) -> str:
    """The first host of a Slurm node list (``ddpq-n[1-2],gpu7`` → ``ddpq-n1``)."""
    nodes = parse_node_list(nodelist)
    if not nodes:
        raise SlurmTopologyError(f"empty SLURM_JOB_NODELIST {nodelist!r}")
    return str(nodes[0])


def _need(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name)
    if not value:
        raise SlurmTopologyError(f"{name} is not set: this must run inside a Slurm task (srun)")
    return value


def topology_from_slurm(environ: Mapping[str, str]) -> dict[str, str]:
    """torch.distributed's variables (names in ``worker.attempt``) from Slurm's.

    ``MASTER_ADDR`` is the first node's *name*; ``resolve_node_address`` turns it into an
    address. Pure: reads only ``environ``.

    Raises:
        SlurmTopologyError: a Slurm variable is missing or not a number.
    """
    try:
        ntasks = int(_need(environ, "SLURM_NTASKS"))
        nnodes = int(environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or 1)
        rank = int(_need(environ, "SLURM_PROCID"))
        local_rank = int(_need(environ, "SLURM_LOCALID"))
    except ValueError as exc:
        raise SlurmTopologyError(f"bad Slurm task variable: {exc}") from None
    job_id = _need(environ, "SLURM_JOB_ID")
    return {
        attempt.RANK: str(rank),
        attempt.LOCAL_RANK: str(local_rank),
        attempt.WORLD_SIZE: str(ntasks),
        attempt.LOCAL_WORLD_SIZE: str(max(1, ntasks // max(1, nnodes))),
        attempt.MASTER_ADDR: first_node(_need(environ, "SLURM_JOB_NODELIST")),
        attempt.MASTER_PORT: str(master_port_for(job_id)),
    }


def resolve_node_address(node: str) -> str:
    """An address other ranks can connect to for Slurm node ``node``.

    The node name itself when it resolves (the usual cluster), else the ``NodeAddr`` Slurm
    knows for it (``scontrol show node``), e.g. several slurmd "nodes" on one test machine.
    """
    try:
        socket.getaddrinfo(node, None)
        return node
    except OSError:
        pass
    try:
        out = subprocess.run(
            ["scontrol", "show", "node", node, "-o"],
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_S,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise SlurmTopologyError(
            f"node {node!r} does not resolve and scontrol failed: {exc}"
        ) from exc
    for word in out.split():
        if word.startswith("NodeAddr="):
            return word.split("=", 1)[1]
    raise SlurmTopologyError(f"node {node!r} does not resolve and has no NodeAddr in Slurm")


def topo_job_id(environ: Mapping[str, str]) -> str:
    """This task's Slurm job id."""
    return _need(environ, "SLURM_JOB_ID")


def parse_time_left(text: str) -> float | None:
    """Seconds from squeue's ``%L`` (``[D-]HH:MM:SS``, ``MM:SS``); None when unlimited/unknown."""
    text = text.strip()
    days = 0
    if "-" in text:
        d, _, text = text.partition("-")
        if not d.isdigit():
            return None
        days = int(d)
    parts = text.split(":")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    seconds = 0
    for p in parts:
        seconds = seconds * 60 + int(p)
    return float(days * 86400 + seconds)


def near_time_limit(scheduler_job_id: str, margin_s: float = TIME_LIMIT_MARGIN_S) -> bool:
    """Whether Slurm's time limit is within ``margin_s`` seconds (so its warning signal meant
    "time is up", not a preemption). False when squeue cannot tell."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", scheduler_job_id, "-o", "%L"],
            capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return False
    left = parse_time_left(out)
    return left is not None and left <= margin_s


@dataclass(frozen=True)
class SlurmRank:
    """The picklable function submitit runs once per Slurm task (one task = one rank).

    ``env`` holds ddpq's variables for the ranks (job id, attempt, artifact directory, the
    API's URL and the attempt token); they travel in submitit's pickle (its folder is the
    worker user's alone, mode 0700), so the token never appears in the sbatch script or in
    ``scontrol show job``. No database URL: Slurm ranks report through the attempt API.
    """

    env: dict[str, str] = field(default_factory=dict)

    def __call__(self) -> int:
        """Run this task's rank; ends the process with the rank's exit code (never returns)."""
        code = int(ExitCode.FAILED)
        try:
            environ = dict(os.environ)
            environ.update(self.env)
            topo = topology_from_slurm(environ)
            topo[attempt.MASTER_ADDR] = resolve_node_address(topo[attempt.MASTER_ADDR])
            environ.update(topo)
            os.environ.update({**self.env, **topo})
            from worker.runtime.main import run_rank

            code = int(run_rank(environ))
            if code == signal_exit(PREEMPT_SIGNAL):
                # Slurm garbles codes above 128 in its accounting: say which stop it was.
                near = near_time_limit(topo_job_id(environ))
                code = int(ExitCode.TIME_LIMIT if near else ExitCode.PREEMPTED)
        except BaseException as exc:  # the exit code carries it to Slurm
            log.exception("slurm rank failed before or outside the runtime: %s", exc)
            code = int(ExitCode.FAILED)
        finally:
            exit_now(code)
