"""``ddpq`` outside ddpq: plain ``python train.py`` or ``torchrun ... train.py``.

Every call works so that one script runs both ways: ``report`` prints a line on rank 0 every
``DDPQ_LOG_EVERY`` steps (default 10), checkpoints are files ``step-<N>.pt`` in
``./ddpq-checkpoints/`` (``DDPQ_LOCAL_CHECKPOINT_DIR`` to change; written atomically by rank 0,
the newest ``KEEP`` kept), ``should_stop`` is False, ``config`` gives the defaults. torch is
imported only by the calls that need it.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from ddpq._state import Info

LOG_EVERY_ENV = "DDPQ_LOG_EVERY"
CHECKPOINT_DIR_ENV = "DDPQ_LOCAL_CHECKPOINT_DIR"
DEFAULT_LOG_EVERY = 10
DEFAULT_CHECKPOINT_DIR = "ddpq-checkpoints"
KEEP = 3  # as training.keep_checkpoints' default
_NAME_RE = re.compile(r"^step-(\d+)\.pt$")


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


class LocalSession:
    """The session of a process that ddpq did not start (see the module docstring)."""

    def __init__(self) -> None:
        self.rank = _env_int("RANK", 0)
        self.local_rank = _env_int("LOCAL_RANK", 0)
        self.world_size = _env_int("WORLD_SIZE", 1)
        self.log_every = max(1, _env_int(LOG_EVERY_ENV, DEFAULT_LOG_EVERY))
        self.checkpoint_dir = Path(os.environ.get(CHECKPOINT_DIR_ENV) or DEFAULT_CHECKPOINT_DIR)
        self._resumed_from: int | None = None

    def report_metrics(
        self, step: Any, epoch: Any, metrics: Any = None, *, mean: bool = False
    ) -> None:
        """Print ``metrics`` on rank 0 when ``step`` is a multiple of ``log_every`` (with
        ``mean``, averaged over the ranks first when a process group is up: every rank
        calls)."""
        metrics = dict(metrics or {})
        step, epoch = _checked(step, epoch, metrics)
        if mean and self.world_size > 1:
            metrics = _mean_over_ranks(metrics)
        if self.rank != 0 or step % self.log_every:
            return
        said = " ".join(f"{name}={_number(value):.6g}" for name, value in metrics.items())
        where = f"step {step}" if epoch is None else f"epoch {int(epoch)} step {step}"
        print(f"[ddpq] {where}: {said}", file=sys.stdout, flush=True)

    def save_checkpoint(self, state: Any, step: int, epoch: int = 0) -> None:
        """Rank 0 writes ``step-<step>.pt`` (temp file, fsync, rename) and keeps the newest
        ``KEEP``; other ranks do nothing."""
        step, _ = _checked(step, epoch, {})
        if self.rank != 0:
            return
        import torch

        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        final = self.checkpoint_dir / f"step-{int(step)}.pt"
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        for old in self._steps()[:-KEEP]:
            (self.checkpoint_dir / f"step-{old}.pt").unlink(missing_ok=True)

    def load_checkpoint(self, map_location: Any = None) -> Any:
        """The newest ``step-<N>.pt`` loaded onto ``map_location`` (default
        ``cuda:<local_rank>`` when CUDA is available, else CPU); None when there is none."""
        steps = self._steps()
        if not steps:
            return None
        import torch

        if map_location is None:
            map_location = f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu"
        path = self.checkpoint_dir / f"step-{steps[-1]}.pt"
        self._resumed_from = steps[-1]
        return torch.load(path, map_location=map_location, weights_only=False)

    def should_stop(self) -> bool:
        """Never: nothing outside ddpq asks a script to stop."""
        return False

    def config_values(self) -> dict[str, Any]:
        """No job spec: nothing over the defaults."""
        return {}

    def info(self) -> Info:
        """torchrun's place of this process; no job."""
        return Info(
            under_ddpq=False, job_id=None, attempt=1, rank=self.rank, local_rank=self.local_rank,
            world_size=self.world_size, resumed_from_step=self._resumed_from,
        )  # fmt: skip

    def _steps(self) -> list[int]:
        try:
            names = os.listdir(self.checkpoint_dir)
        except OSError:
            return []
        return sorted(int(m[1]) for m in map(_NAME_RE.match, names) if m)


def _checked(step: Any, epoch: Any, metrics: dict[str, Any]) -> tuple[int, int | None]:
    """``step`` and ``epoch`` as under ddpq: the same rules, the same ``ValueError``s
    (``service.core.metrics.points.checked_report``, imported at the first call), and a
    tensor metric must hold one number."""
    for name, value in metrics.items():
        if hasattr(value, "numel") and value.numel() != 1:
            raise ValueError(f"metric {name!r}: a tensor of shape {tuple(value.shape)}; "
                             "report one number (e.g. loss.mean())")  # fmt: skip
    try:
        from service.core.metrics.points import checked_report
    except ImportError:  # a project's own ``service`` module stands in the way: the basics
        if int(step) < 1 or (epoch is not None and int(epoch) < 0):
            raise ValueError(f"step must be ≥ 1 and epoch ≥ 0, got {step}, {epoch}") from None
        return int(step), None if epoch is None else int(epoch)
    return checked_report(step, epoch, metrics)


def _number(value: Any) -> float:
    return float(value.item()) if hasattr(value, "item") else float(value)


def _mean_over_ranks(metrics: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    if not metrics or not (dist.is_available() and dist.is_initialized()):
        return metrics
    values = [
        v.detach().reshape(()).double() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
        for v in metrics.values()
    ]
    gloo = dist.get_backend() == "gloo"
    device = torch.device("cpu") if gloo else torch.device("cuda", torch.cuda.current_device())
    stacked = torch.stack([v.to(device, torch.float64) for v in values])
    dist.all_reduce(stacked)
    means = (stacked / dist.get_world_size()).tolist()
    return dict(zip(metrics, means, strict=True))
