"""Names of the environment variables a launcher sets for every rank process (one place)."""

from __future__ import annotations

# Identify the job's processes (operators find them by these) and fence their writes.
JOB_ID = "DDPQ_JOB_ID"
ATTEMPT = "DDPQ_ATTEMPT"
# Where the rank reads its spec and writes metrics/checkpoints; same names as Settings reads.
DATABASE_URL = "DDPQ_DATABASE_URL"
ARTIFACT_DIR = "DDPQ_ARTIFACT_DIR"

# Set by torchrun (env:// rendezvous); on Slurm the runtime derives them from SLURM_* vars.
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"

# Optional, read by the rank runtime: seconds a collective may block before the process group
# gives up (init_process_group's timeout). Default: worker.runtime.topology.DEFAULT_PG_TIMEOUT_S.
PG_TIMEOUT_S = "DDPQ_PG_TIMEOUT_S"
