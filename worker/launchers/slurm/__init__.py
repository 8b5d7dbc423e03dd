"""The Slurm launcher: submitit, job arrays, sacct states."""
