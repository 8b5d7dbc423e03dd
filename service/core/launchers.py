"""Launcher traits: what the rest of ddpq may assume about each launcher, in one table.

The spec (which names are valid), the claim's inputs, ``queue_reason``, the leases (requeue
versus adoption), the worker loop and the registry (where the class lives) read a launcher
from here, never from its name. Adding a launcher means one module with its class and one
row here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Traits:
    """What one launcher does, as far as code outside the launcher needs to know.

    Attributes:
        host_gpus: its ranks run on the worker's own host, so the worker hands out its own
            GPUs to jobs (and a job waits for a worker with enough free ones); otherwise GPU
            placement is the backend's business.
        detached: its attempts outlive the worker that started them (a batch scheduler): the
            worker records the backend's id (``scheduler_job_id``) after ``start`` and, at a
            clean shutdown, leaves its jobs running instead of stopping them.
        adopts: a worker of this launcher takes over (adopts) the submitted jobs of lost or
            stopped workers by their ``scheduler_job_id``; the lease reaper skips those jobs
            instead of requeueing a second copy. Only meaningful with ``detached``.
        multi_node: a job may span several hosts (``resources.nnodes > 1``).
        title: how messages and logs name the backend ("Slurm job 42").
        implementation: ``"module:ClassName"`` of its class (a string: the worker imports it
            only when a worker runs this launcher; see ``worker.launchers.registry``).
    """

    host_gpus: bool
    detached: bool
    adopts: bool
    multi_node: bool
    title: str = ""
    implementation: str = ""

    def __post_init__(self) -> None:
        if self.adopts and not self.detached:
            raise ValueError("a launcher that adopts jobs must be detached")


LAUNCHER_TRAITS: dict[str, Traits] = {
    "local": Traits(
        host_gpus=True,
        detached=False,
        adopts=False,
        multi_node=False,
        title="local",
        implementation="worker.launchers.local.launcher:LocalLauncher",
    ),
    "slurm": Traits(
        host_gpus=False,
        detached=True,
        adopts=True,
        multi_node=True,
        title="Slurm",
        implementation="worker.launchers.slurm.launcher:SlurmLauncher",
    ),
}


def launcher_names() -> tuple[str, ...]:
    """Every launcher name, in table order (e.g. ``("local", "slurm")``)."""
    return tuple(LAUNCHER_TRAITS)


def launcher_traits(name: str) -> Traits:
    """The traits of the launcher called ``name``.

    Raises:
        KeyError: unknown launcher (the message lists the known ones).
    """
    try:
        return LAUNCHER_TRAITS[name]
    except KeyError:
        raise KeyError(
            f"unknown launcher {name!r}; choose one of: {', '.join(launcher_names())}"
        ) from None


def check_launcher_name(name: str) -> str:
    """``name`` when it has a row in the table (the spec's ``launcher`` validator).

    Raises:
        ValueError: unknown launcher (the message lists the known ones).
    """
    if name not in LAUNCHER_TRAITS:
        raise ValueError(f"unknown launcher {name!r}; choose one of: {', '.join(launcher_names())}")
    return name


def uses_host_gpus(name: str) -> bool:
    """Whether jobs of launcher ``name`` take GPUs from their worker's own pool (False for an
    unknown name)."""
    traits = LAUNCHER_TRAITS.get(name)
    return traits is not None and traits.host_gpus


def adopting_launchers() -> tuple[str, ...]:
    """Names of the launchers whose workers adopt detached jobs (e.g. ``("slurm",)``)."""
    return tuple(n for n, t in LAUNCHER_TRAITS.items() if t.adopts)


def multi_node_launchers() -> tuple[str, ...]:
    """Names of the launchers whose jobs may span several hosts (e.g. ``("slurm",)``)."""
    return tuple(n for n, t in LAUNCHER_TRAITS.items() if t.multi_node)
