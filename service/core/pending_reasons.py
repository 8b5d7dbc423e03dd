"""Why a batch scheduler keeps a submitted job pending: Slurm's reason codes in plain words.

The Slurm worker asks ``squeue -o %r`` for its pending jobs and records each new reason as a
``scheduler_pending`` job event (``service.core.events``, data ``{code, words}``);
``GET /jobs/{id}`` finds the newest one of the current attempt and explains its code with
``describe_slurm_reason``.
"""

from __future__ import annotations

MAX_REASON_CODE_CHARS = 200  # a pending reason code is stored cut to this

# squeue's JOB REASON CODES (man squeue) that people meet most, in plain words.
SLURM_PENDING_REASONS: dict[str, str] = {
    "None": "Slurm has not decided yet (the job was just submitted)",
    "Resources": "waiting for the nodes, CPUs, GPUs or memory it asked for to become free",
    "Priority": "jobs with a higher Slurm priority are ahead of it in the partition",
    "Dependency": "waiting for a job it depends on to finish",
    "DependencyNeverSatisfied": "a job it depends on failed, so it can never start",
    "JobHeldUser": "held by its user (`scontrol release <id>` lets it go)",
    "JobHeldAdmin": "held by a Slurm administrator (`scontrol release <id>` lets it go)",
    "BeginTime": "its requested start time has not come yet",
    "ReqNodeNotAvail": "a node it needs is down, drained or reserved",
    "NodeDown": "a node it needs is down",
    "BadConstraints": "no node has the features (constraint) it asks for",
    "PartitionNodeLimit": "it asks for more nodes than its partition allows",
    "PartitionTimeLimit": "its time limit is longer than its partition allows",
    "PartitionDown": "its partition is down",
    "PartitionInactive": "its partition is inactive",
    "Reservation": "waiting for its advance reservation to start",
    "QOSMaxJobsPerUserLimit": "its QOS allows no more running jobs for this user now",
    "QOSMaxSubmitJobPerUserLimit": "its QOS allows no more submitted jobs for this user",
    "QOSMaxCpuPerUserLimit": "its QOS allows no more CPUs for this user now",
    "QOSMaxGRESPerUser": "its QOS allows no more GPUs (GRES) for this user now",
    "QOSMaxWallDurationPerJobLimit": "its time limit is longer than its QOS allows",
    "AssocMaxJobsLimit": "its account allows no more running jobs now",
    "AssocGrpCpuLimit": "its account's group is at its CPU limit",
    "AssocGrpGRES": "its account's group is at its GPU (GRES) limit",
    "launch failed requeued held": "Slurm could not start it and held it (see slurmctld's log)",
}


def describe_slurm_reason(code: str) -> str:
    """Slurm's pending reason ``code`` (as ``squeue -o %r`` prints it) in plain words.

    Codes with details (``ReqNodeNotAvail, UnavailableNodes:n1``) are explained by their
    first word; unknown ``QOS*`` / ``Assoc*`` codes as a QOS or account limit; anything else
    points at ``man squeue``.
    """
    code = code.strip()
    if code in SLURM_PENDING_REASONS:
        return SLURM_PENDING_REASONS[code]
    head = code.replace(",", " ").split(" ")[0] if code else ""
    if head in SLURM_PENDING_REASONS:
        return f"{SLURM_PENDING_REASONS[head]} ({code})"
    if head.startswith("QOS"):
        return f"a limit of its QOS is reached ({code})"
    if head.startswith("Assoc"):
        return f"a limit of its account (association) is reached ({code})"
    return f"Slurm's reason {code!r} (see JOB REASON CODES in `man squeue`)"
