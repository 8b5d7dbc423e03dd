"""The sbatch parameters of one Slurm attempt, from its spec: a pure function, golden-tested
through ``SlurmLauncher.plan``, and ``SlurmBatchRequest``, the Slurm launcher's typed part of a
plan."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.core.spec.model import JobSpec
from worker.attempt import API_URL, rank_env
from worker.errors import LaunchError
from worker.launchers.slurm.states import PREEMPT_SIGNAL, slurm_job_name
from worker.launchers.slurm.submitit_adapter import convert_mem

DEFAULT_SIGNAL_DELAY_S = 60  # Slurm's USR1 warning, seconds before the time limit
# sbatch options ddpq sets itself; a spec's slurm.extra may not override them.
RESERVED_SBATCH_OPTIONS = frozenset(
    {"job-name", "nodes", "ntasks-per-node", "ntasks", "output", "error", "signal", "chdir",
     "open-mode", "array", "wrap"}
)  # fmt: skip


@dataclass(frozen=True)
class SlurmBatchRequest:
    """What ``SlurmLauncher.start`` submits, besides the plan's script and environment.

    ``folder``: submitit's folder for the attempt (the job's pickles and task logs).
    ``parameters``: ``SlurmExecutor.update_parameters`` keyword arguments (submitit's names,
    as ``sbatch_parameters`` builds them); the rendered script is made from exactly these.
    Holds no secret: the attempt token travels only in submitit's pickle (``SlurmRank``).
    """

    folder: str
    parameters: dict[str, Any]


def sbatch_parameters(
    spec: JobSpec,
    job_id: int,
    attempt: int,
    *,
    cwd: str,
    artifact_dir: Path,
    api_url: str,
    default_partition: str | None = None,
    signal_delay_s: int = DEFAULT_SIGNAL_DELAY_S,
) -> dict[str, Any]:
    """submitit ``SlurmExecutor`` parameters (its own names) for one attempt. Pure.

    Raises:
        LaunchError: ``spec.slurm.extra`` tries to set an option ddpq manages.
    """
    r = spec.resources
    opts = spec.slurm
    extra: dict[str, Any] = {}
    for key, value in (opts.extra if opts else {}).items():
        name = key.lstrip("-").replace("_", "-")
        if name in RESERVED_SBATCH_OPTIONS:
            raise LaunchError(
                f"slurm.extra may not set --{name}: ddpq sets it (reserved: "
                f"{', '.join(sorted(RESERVED_SBATCH_OPTIONS))})"
            )
        extra[name] = value
    env = rank_environment(spec, job_id, attempt, artifact_dir=artifact_dir, api_url=api_url)
    params: dict[str, Any] = {
        "job_name": slurm_job_name(job_id, attempt),
        "time": (opts.time_limit_min if opts and opts.time_limit_min else r.timeout_min),
        "nodes": r.nnodes,
        "ntasks_per_node": r.nproc_per_node,
        "cpus_per_task": r.cpus_per_task,
        "setup": [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())],
        "additional_parameters": {
            **extra,
            "signal": f"{PREEMPT_SIGNAL.name.removeprefix('SIG')}@{int(signal_delay_s)}",
            "chdir": cwd,
        },
    }
    if r.gpus_per_node:
        params["gpus_per_node"] = r.gpus_per_node
    if r.mem_gb is not None:
        params["mem"] = convert_mem(r.mem_gb)
    partition = (opts.partition if opts else None) or default_partition
    named: tuple[tuple[str, str | None], ...] = (
        ("partition", partition),
        ("account", opts.account if opts else None),
        ("qos", opts.qos if opts else None),
        ("constraint", opts.constraint if opts else None),
    )
    for option, setting in named:
        if setting:
            params[option] = setting
    return params


def rank_environment(
    spec: JobSpec, job_id: int, attempt: int, *, artifact_dir: Path, api_url: str
) -> dict[str, str]:
    """ddpq's variables every rank gets (``worker.attempt.rank_env``) and the API's URL,
    exported by the sbatch script. Nothing secret: the attempt token and the topology are
    added inside the task (``SlurmRank``); no database URL reaches a Slurm rank at all."""
    env = rank_env(
        job_id, attempt, artifact_dir=artifact_dir, cpus_per_task=spec.resources.cpus_per_task,
        user_env=spec.env,
    )  # fmt: skip
    return {**env, API_URL: api_url}
