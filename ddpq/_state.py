"""Which session this process's ``ddpq`` calls reach, decided at the first call.

- A rank of an entrypoint or built-in task: the ``TrainContext`` the rank registered (``use``).
- A command job's script (``DDPQ_JOB_ID`` and ``DDPQ_ATTEMPT_TOKEN`` in the environment): a
  session built from that environment (``worker.runtime.script.session``).
- Anything else (plain ``python``, plain ``torchrun``): ``ddpq._local.LocalSession``.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# The variables a launcher of ddpq sets for every rank (worker.attempt's JOB_ID, ATTEMPT_TOKEN).
_LIVE_MARKERS = ("DDPQ_JOB_ID", "DDPQ_ATTEMPT_TOKEN")
# ddpq's own top-level packages, installed beside this one.
_OWN_PACKAGES = ("service", "worker")


class Session(Protocol):
    """What ``ddpq``'s functions call: ``worker.runtime.train.session.RankSession`` or
    ``ddpq._local.LocalSession``."""

    def report_metrics(
        self, step: Any, epoch: Any, metrics: Any = None, *, mean: bool = False
    ) -> None: ...
    def save_checkpoint(self, state: Any, step: int, epoch: int = 0) -> None: ...
    def load_checkpoint(self, map_location: Any = None) -> Any: ...
    def should_stop(self) -> bool: ...
    def config_values(self) -> dict[str, Any]: ...
    def info(self) -> Info: ...


@dataclass(frozen=True)
class Info:
    """Who and where this process is.

    Attributes:
        under_ddpq: False under plain ``python``/``torchrun``.
        job_id, attempt: the job and its attempt (1, then +1 per relaunch); None/1 outside ddpq.
        rank, local_rank, world_size: torchrun's.
        resumed_from_step: the checkpoint step this attempt started from (restored by ddpq or
            loaded with ``load_checkpoint``); None on a fresh start or before it is known.
        seed: the spec's ``training.seed`` (a sweep's ``seeds`` replicas differ by it: seed
            your RNGs with it); None outside ddpq.
    """

    under_ddpq: bool
    job_id: int | None
    attempt: int
    rank: int
    local_rank: int
    world_size: int
    resumed_from_step: int | None
    seed: int | None = None


_lock = threading.Lock()
_session: Session | None = None


def use(session: Session | None) -> None:
    """Make ``session`` the one this process's ``ddpq`` calls reach (a rank's TrainContext);
    None forgets it (the next call decides again)."""
    global _session
    with _lock:
        _session = session


def current() -> Session:
    """This process's session, built at the first call.

    Raises:
        ImportError: under ddpq, when the script's own top-level ``service`` or ``worker``
            module shadows ddpq's (the message says which).
    """
    global _session
    if _session is None:
        with _lock:
            if _session is None:
                _session = _build()
    return _session


def info() -> Info:
    """Who and where this process is (see ``Info``)."""
    return current().info()


def _build() -> Session:
    if all(os.environ.get(name) for name in _LIVE_MARKERS):
        return _import_live().script_session()
    from ddpq._local import LocalSession

    return LocalSession()


def _import_live() -> Any:
    """``worker.runtime.script.session``, ddpq's runtime, imported from beside this package.

    ddpq's runtime lives in the top-level packages ``service`` and ``worker``; a script whose
    own modules of those names come first on ``sys.path`` would get ddpq's instead of its own
    (or ddpq would get the script's). Both are refused with a message that says so.

    Raises:
        ImportError: the script has (or already imported) its own ``service`` or ``worker``.
    """
    root = Path(__file__).resolve().parent.parent
    for name in _OWN_PACKAGES:
        loaded = sys.modules.get(name)
        where = getattr(loaded, "__file__", None) if loaded is not None else None
        if loaded is not None and (where is None or Path(where).resolve().parent != root / name):
            raise ImportError(_shadowed(name, str(where or loaded)))
        if loaded is None:
            mine = _shadowing(name, root)
            if mine is not None:
                raise ImportError(_shadowed(name, str(mine)))
    sys.path.insert(0, str(root))
    try:
        import worker.runtime.script.session as live
    finally:
        sys.path.remove(str(root))
    return live


def _shadowing(name: str, root: Path) -> Path | None:
    """The script's own module ``name`` that ``import name`` would find before ddpq's: a
    package directory or a ``.py`` file on ``sys.path`` ahead of ddpq's ``root``."""
    for entry in sys.path:
        folder = Path(entry or os.getcwd()).resolve()
        if folder == root:
            return None
        # A regular package or a module wins over ours; a directory without __init__.py
        # would be a namespace package, which a regular package anywhere on the path beats.
        for candidate in (folder / name / "__init__.py", folder / f"{name}.py"):
            if candidate.exists():
                return candidate.parent if candidate.name == "__init__.py" else candidate
    return None


def _shadowed(name: str, where: str) -> str:
    return (
        f"ddpq's runtime is the top-level package {name!r}, and your project has its own "
        f"({where}): under ddpq, rename yours to call ddpq's functions (a script that does "
        "not import ddpq runs as it is)"
    )
