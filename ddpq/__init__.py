"""ddpq inside your own training script: a few optional lines for what only ddpq gives.

```python
import ddpq

cfg = ddpq.config({"lr": 0.1, "epochs": 10})     # the job's config (a sweep's values), else these
state = ddpq.load_checkpoint()                    # the newest checkpoint, on any host, or None
for epoch in range(start, cfg["epochs"]):
    ...
    ddpq.report(step, loss=loss)                  # rank 0's points: the job's loss curve
    if ddpq.should_stop():                        # cancel, preemption, worker shutdown
        ddpq.save_checkpoint(state, step)         # then return: a preempted job is requeued
        break
```

Under ddpq (a command job or an entrypoint), each call goes to the rank's one set of services
(``worker.runtime.train.session.RankSession``): the metrics sink (batched, spilled to a file while
the API is away, written exactly once, fenced to this attempt), the checkpointer (async
snapshot, atomic write, sha256, upload through the API) and the stop vote. Outside ddpq (plain
``python`` or ``torchrun``) every call works locally: ``report`` prints a line every
``DDPQ_LOG_EVERY`` (10) steps on rank 0, checkpoints go to ``./ddpq-checkpoints/`` (or
``DDPQ_LOCAL_CHECKPOINT_DIR``), ``should_stop`` is False. One script runs both ways.

``import ddpq`` imports the standard library only; torch and ddpq's runtime are imported at
the first call that needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddpq._state import Info, current, info

if TYPE_CHECKING:
    import torch

__all__ = [
    "Info",
    "config",
    "info",
    "load_checkpoint",
    "report",
    "save_checkpoint",
    "should_stop",
]


def report(step: int, *, epoch: int | None = None, mean: bool = False, **metrics: Any) -> None:
    """Record ``metrics`` (floats or 0-d tensors) at global ``step`` (1-based, increasing).

    Only rank 0's values are kept and other ranks' calls cost nothing, unless ``mean=True``:
    then every rank must make the same call; the values are averaged over the ranks first (one
    all_reduce and one host sync per call, so report every few steps) and each point says it
    is a mean over the world size. Tensors stay on their device until a batch is written.

    Raises:
        ValueError: a step below 1, an epoch below 0 or a metric name over 100 characters.
        NonFiniteLossError: under ddpq, a NaN/inf ``loss`` with ``training.nonfinite_loss: fail``.
    """
    current().report_metrics(step, epoch, metrics, mean=mean)


def save_checkpoint(obj: Any, step: int, *, epoch: int = 0) -> None:
    """Checkpoint ``obj`` (any picklable object, e.g. ``{"model": model.state_dict(), ...}``)
    at ``step``. Call it on every rank (or rank 0 alone): rank 0's is kept. Under ddpq its
    tensors are copied now and the file is written, hashed (sha256) and uploaded in the
    background; the job's checkpoint list shows it once the API verified it."""
    current().save_checkpoint(obj, step, epoch)


def load_checkpoint(map_location: str | torch.device | None = None) -> Any:
    """The newest verified checkpoint of this job (any attempt, fetched onto this host through
    the API when another host wrote it), loaded onto ``map_location`` (default: this rank's
    device, ``cuda:<local_rank>`` when the job has GPUs); None on a fresh start. Under ddpq a
    collective: call it on every rank at the same point (after ``init_process_group``).

    Raises:
        CheckpointFetchError: a checkpoint exists but could not be brought onto this host.
    """
    return current().load_checkpoint(map_location)


def should_stop() -> bool:
    """True when the job must stop now: a cancel, a preemption (Slurm's warning signal) or the
    worker's shutdown, agreed across ranks (every rank gets True at the same call). Call it
    once per step on every rank; after True, save a checkpoint and return: ddpq then requeues a
    preempted job instead of calling it done. Until the first call, a stop signal ends the
    script at once (after writing what it reported). Always False outside ddpq."""
    return current().should_stop()


def config(defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """The job spec's ``config`` object (e.g. the values of a sweep's trial) over
    ``defaults``: a key the spec sets wins. Outside ddpq: a copy of ``defaults``."""
    merged = dict(defaults or {})
    merged.update(current().config_values())
    return merged
