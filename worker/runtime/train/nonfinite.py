"""The non-finite loss policy (``training.nonfinite_loss``): one answer on every rank, with no
collective of its own.

How the ranks agree without an extra all_reduce: before ``backward`` the loss is multiplied by
``1 + 0 × loss.detach()`` (``poison_gradients``), exactly 1 for a finite loss and NaN for a
NaN/inf one, so a rank whose loss is non-finite gets NaN gradients. DDP's gradient all_reduce
(the one every step does anyway) then spreads them: after ``backward`` every rank holds the
same averaged gradients, finite on all ranks or on none. ``NonFinitePolicy.allows_step`` reads
them (one pass over the gradients plus one host sync per step, like AMP's GradScaler) and
every rank takes the same branch, so no rank waits in a collective its peers skipped.
A gradient that overflows in ``backward`` with a finite loss counts the same way.

Custom entrypoints run their own optimizer step, so there the policy reads what they report:
``TrainContext.report(step, loss=...)`` hands each value named ``loss`` to
``NonFinitePolicy.check_reported``; with ``fail`` a non-finite one raises
``NonFiniteLossError`` (see ``TrainContext.report`` for when).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from typing import Literal

import torch
from torch import nn

from worker.attempt import FailureReason

log = logging.getLogger(__name__)
NonFiniteMode = Literal["fail", "skip_step"]
# The metric a custom loop reports its training loss as (``ctx.report(step, loss=...)``).
REPORTED_LOSS = "loss"


class NonFiniteLossError(RuntimeError):
    """The loss or the gradients were NaN/inf with ``training.nonfinite_loss: fail``."""

    reason = FailureReason.NONFINITE_LOSS


def poison_gradients(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` for ``backward``: bitwise the same when finite, NaN (so NaN gradients) when
    not. Elementwise on the loss's device: no host sync."""
    return loss * (1 + 0 * loss.detach())


def gradients_finite(params: Iterable[nn.Parameter]) -> bool:
    """Whether every gradient element is finite (a host sync).

    The fast test is one L2 norm per tensor; a non-finite total is confirmed with the max-abs
    norm, because squares of huge but finite gradients (> ~1e19 in float32) overflow too.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return True
    norms = torch._foreach_norm(grads)
    if bool(torch.stack([n.float() for n in norms]).isfinite().all()):
        return True
    exact = torch._foreach_norm(grads, math.inf)
    return bool(torch.stack([n.float() for n in exact]).isfinite().all())


def first_nonfinite(points: Sequence[tuple[int, torch.Tensor]]) -> tuple[int, float] | None:
    """The first ``(step, value)`` of ``points`` (scalar tensors, one device) whose value is
    NaN/inf, or None: one host sync for the whole batch (two when one is found)."""
    if not points:
        return None
    values = torch.stack([t.detach().reshape(()).float() for _, t in points])
    finite = values.isfinite()
    if bool(finite.all()):
        return None
    i = int((~finite).nonzero()[0, 0])
    return points[i][0], float(values[i])


class NonFinitePolicy:
    """Applies ``training.nonfinite_loss`` after ``backward``, the same on every rank.

    ``skipped`` counts the steps skipped so far (this attempt); ``rank`` is for messages.
    """

    def __init__(self, mode: NonFiniteMode, rank: int = 0) -> None:
        self.mode, self.rank = mode, rank
        self.skipped = 0

    def allows_step(self, step: int, loss: torch.Tensor, params: Iterable[nn.Parameter]) -> bool:
        """True when the optimizer may step; False to skip this step (``skip_step``).

        Call after ``poison_gradients(loss).backward()`` (DDP has all-reduced the gradients).

        Raises:
            NonFiniteLossError: non-finite with mode ``fail``; the message names the step
                and this rank's own loss.
        """
        if gradients_finite(params):
            return True
        local = float(loss.detach().float().item())
        here = (
            f"rank {self.rank}'s loss was {local}"
            if not math.isfinite(local)
            else f"rank {self.rank}'s loss was finite (another rank's or the gradients were not)"
        )
        if self.mode == "fail":
            raise NonFiniteLossError(
                f"non-finite loss or gradients at step {step} (training.nonfinite_loss=fail); "
                f"{here}"
            )
        self.skipped += 1
        log.warning(
            "non-finite loss or gradients at step %d: optimizer step skipped on every rank "
            "(%d skipped so far); %s",
            step,
            self.skipped,
            here,
        )
        return False

    @property
    def checks_reports(self) -> bool:
        """Whether reported losses of a custom loop are checked (mode ``fail``). With
        ``skip_step`` they are not: ddpq cannot skip an optimizer step it does not run."""
        return self.mode == "fail"

    def check_reported(self, step: int, value: float) -> None:
        """Apply the policy to a loss a custom loop reported at ``step``.

        Raises:
            NonFiniteLossError: ``value`` is NaN/inf with mode ``fail``.
        """
        if self.mode == "fail" and not math.isfinite(value):
            raise NonFiniteLossError(
                f"non-finite loss reported at step {step} (training.nonfinite_loss=fail); "
                f"rank {self.rank}'s loss was {value}"
            )
