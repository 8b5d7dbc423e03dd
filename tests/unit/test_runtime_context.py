"""``training.nonfinite_loss`` on a custom loop's reports (``TrainContext.report``): a float
``loss`` is checked at the call, a tensor one when its batch is flushed (no per-step sync);
``skip_step`` records the values as they are."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from service.core.spec.model import JobSpec
from worker.attempt import FailureReason, reason_of
from worker.runtime.checkpoints.saver import NullCheckpointer
from worker.runtime.distributed import DistContext
from worker.runtime.metrics.buffer import NullSink
from worker.runtime.signals import StopFlag
from worker.runtime.train.context import TrainContext
from worker.runtime.train.nonfinite import NonFiniteLossError


def _ctx(tmp_path: Path, mode: str) -> tuple[TrainContext, NullSink]:
    dist = DistContext(0, 0, 1, torch.device("cpu"), "ddp", None)
    spec = JobSpec.model_validate(
        {"name": "c", "task": "examples.custom_loop:train", "training": {"nonfinite_loss": mode}}
    )
    sink = NullSink(dist)
    ctx = TrainContext(spec=spec, dist=dist, sink=sink, checkpointer=NullCheckpointer(),
                       stop=StopFlag(), api=None, artifact_dir=tmp_path, job_id=1,
                       attempt=1)  # fmt: skip
    return ctx, sink


def test_a_nan_float_loss_fails_at_the_call(tmp_path: Path) -> None:
    ctx, _ = _ctx(tmp_path, "fail")
    ctx.report(1, loss=0.5, acc=math.nan)  # only ``loss`` is the policy's
    with pytest.raises(NonFiniteLossError, match="at step 2") as raised:
        ctx.report(2, loss=math.inf)
    assert reason_of(raised.value) == FailureReason.NONFINITE_LOSS


def test_a_nan_tensor_loss_fails_at_the_flush_that_copies_it(tmp_path: Path) -> None:
    ctx, sink = _ctx(tmp_path, "fail")
    ctx.report(1, loss=torch.tensor(0.5))  # the first report flushes at once
    ctx.report(2, loss=torch.tensor(math.nan))  # buffered: no host sync, no error yet
    ctx.report(3, loss=torch.tensor(0.25))
    assert sink.pending == 2
    with pytest.raises(NonFiniteLossError, match=r"at step 2 .*loss was nan"):
        ctx.close()
    assert sink.pending == 0, "the batch was handed over before the error"


def test_skip_step_records_nan_losses_as_they_are(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ctx, _ = _ctx(tmp_path, "skip_step")
    ctx.report(1, loss=torch.tensor(math.nan))
    ctx.report(2, loss=math.nan)
    ctx.close()
    warnings = [r for r in caplog.records if "does not apply to a custom loop" in r.message]
    assert len(warnings) == 1, "said once"
