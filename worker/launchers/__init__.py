"""Launchers: the ``Launcher`` protocol and its printable ``LaunchPlan``, which rank to blame for a
failure, preflight checks and dry-run previews; one sub-package per backend (local, slurm)."""
