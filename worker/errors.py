"""Errors raised by the worker side (launchers, the worker loop, ``ddpq up``)."""

from __future__ import annotations

from service.core.errors import DdpqError


class WorkerError(DdpqError):
    """A worker-side failure (launching, supervising or stopping processes)."""

    status_code = 500
    code = "worker_error"


class LaunchError(WorkerError):
    """An attempt could not be started (bad plan, missing executable, unknown launcher)."""

    code = "launch_failed"


class PortInUseError(WorkerError):
    """The API port is already taken by another process."""

    status_code = 409
    code = "port_in_use"


class ChildExitedError(WorkerError):
    """A process that ``ddpq up`` supervises exited on its own."""

    code = "child_exited"


class WorkerConfigError(WorkerError):
    """A worker's settings cannot work (a database URL set, no worker token): the message says
    what to set instead."""

    status_code = 422
    code = "worker_config"
