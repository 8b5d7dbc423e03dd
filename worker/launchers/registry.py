"""Launcher names → launcher objects (the Slurm launcher is imported only when asked for)."""

from __future__ import annotations

import sys
from typing import get_args

from service.core.config import Settings
from service.core.spec import LauncherName
from worker.errors import LaunchError
from worker.launchers.base import Launcher

LAUNCHER_NAMES: tuple[str, ...] = get_args(LauncherName)
# Launchers whose ranks run on the worker's own host: the worker hands out its GPUs to them.
HOST_LAUNCHERS = frozenset({"local"})


def make_launcher(name: str, settings: Settings) -> Launcher:
    """Build the launcher called ``name``; Slurm's gets its ``slurm_*`` settings.

    Raises:
        LaunchError: unknown name (the message lists the valid ones).
    """
    if name == "local":
        from worker.launchers.local import LocalLauncher

        return LocalLauncher(settings)
    if name == "slurm":
        from worker.launchers.slurm import SlurmLauncher  # type: ignore[import-not-found,unused-ignore]

        launcher: Launcher = SlurmLauncher(
            settings,
            python=settings.slurm_python or sys.executable,
            partition=settings.slurm_partition,
            signal_delay_s=settings.slurm_signal_delay_s,
        )
        return launcher
    raise LaunchError(f"unknown launcher {name!r}; choose one of: {', '.join(LAUNCHER_NAMES)}")


def uses_host_gpus(name: str) -> bool:
    """Whether jobs of this launcher run on the worker's host and need GPUs from its pool."""
    return name in HOST_LAUNCHERS
