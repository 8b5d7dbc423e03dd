"""Numbers that several modules must agree on: caps, sizes, page lengths, timeouts. One name
each, with its unit in the name (``_CHARS``, ``_BYTES``, ``_S``) or beside it; a number that
only one module uses stays in that module."""

from __future__ import annotations

# ---- text caps (characters) -------------------------------------------------------------

# A job's name (JobSpec.name), hence the ?q= filter that looks for one and the name the CLI
# derives from a command.
MAX_JOB_NAME_CHARS = 200
# A metric's name: in a rank's batch, a sweep's objective and the ?name= of a history.
MAX_METRIC_NAME_CHARS = 100
# One tag of a job (JobSpec.tags), hence the ?tag= filter.
MAX_TAG_CHARS = 100
# An Idempotency-Key header of POST /jobs and POST /sweeps.
MAX_IDEMPOTENCY_KEY_CHARS = 200
# A file path a rank or a workspace names: Linux's PATH_MAX, in bytes of the encoded path
# (so a path string of more characters never fits either).
MAX_PATH_BYTES = 4096

# ---- pages --------------------------------------------------------------------------------

# Jobs or sweeps on one list page when the caller does not say (items).
DEFAULT_PAGE_ITEMS = 50
# Jobs or sweeps on one list page at most (items): DDPQ_MAX_LIST_LIMIT's default.
MAX_PAGE_ITEMS = 500
# Points of one metric on one page of its history when the caller does not say (points).
METRIC_PAGE_POINTS = 1000

# ---- sweeps -------------------------------------------------------------------------------

# Replicas of each trial (seeds: training.seed + k), in the spec and in an extend (trials).
MAX_SEEDS = 1000

# ---- timeouts (seconds) -------------------------------------------------------------------

# One Slurm command (sacct, squeue, scancel, sinfo, scontrol show) before it counts as hung.
SLURM_COMMAND_TIMEOUT_S = 30.0
