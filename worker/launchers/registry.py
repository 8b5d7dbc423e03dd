"""Launcher names → launcher classes, imported only when a worker asks for one.

Each class builds itself from settings (``from_settings``); where it lives and what the rest
of ddpq may assume about it is its row in ``service.core.launchers.LAUNCHER_TRAITS``
(``implementation``). Adding a launcher means one module with its class and that one row.
"""

from __future__ import annotations

import importlib
from typing import Protocol, cast

from service.core.config import Settings
from service.core.launchers import LAUNCHER_TRAITS, launcher_names
from worker.errors import LaunchError
from worker.launchers.base import Launcher


class LauncherClass(Protocol):
    """A launcher class: builds its launcher from the deployment's settings."""

    def from_settings(self, settings: Settings) -> Launcher:
        """The launcher configured by ``settings`` (e.g. Slurm's ``slurm_*`` settings)."""
        ...


def launcher_class(name: str) -> LauncherClass:
    """Import and return the class of the launcher called ``name``.

    Raises:
        LaunchError: unknown name (the message lists the valid ones).
    """
    traits = LAUNCHER_TRAITS.get(name)
    if traits is None or not traits.implementation:
        choices = ", ".join(launcher_names())
        raise LaunchError(f"unknown launcher {name!r}; choose one of: {choices}")
    module, _, attr = traits.implementation.partition(":")
    return cast(LauncherClass, getattr(importlib.import_module(module), attr))


def make_launcher(name: str, settings: Settings) -> Launcher:
    """Build the launcher called ``name`` from ``settings`` (its class's ``from_settings``).

    Raises:
        LaunchError: unknown name (the message lists the valid ones).
    """
    return launcher_class(name).from_settings(settings)
