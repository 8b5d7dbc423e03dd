"""A rank's session refuses at the call what it could not store later: a metric tensor of
more than one number, a checkpoint step out of range (before, these failed in the background
and broke every later report or save)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service.core.spec.model import JobSpec
from worker.runtime.checkpoints.saver import NullCheckpointer
from worker.runtime.distributed import DistContext
from worker.runtime.metrics.buffer import NullSink
from worker.runtime.signals import StopFlag
from worker.runtime.train.session import RankSession

CPU = DistContext(0, 0, 1, torch.device("cpu"), "ddp", None)


def session(tmp_path: Path) -> RankSession:
    return RankSession(
        spec=JobSpec(name="t", task="regression"), dist=CPU, sink=NullSink(CPU),
        checkpointer=NullCheckpointer(), stop=StopFlag(), api=None, artifact_dir=tmp_path,
        job_id=1, attempt=1,
    )  # fmt: skip


def test_a_tensor_of_several_numbers_is_refused_and_the_buffer_stays_usable(
    tmp_path: Path,
) -> None:
    s = session(tmp_path)
    s.report_metrics(1, 0, {"loss": torch.tensor(0.5)})
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        s.report_metrics(2, 0, {"loss": torch.ones(2)})
    s.report_metrics(3, 0, {"loss": torch.tensor(0.25)})
    s.report_metrics(4, 0, {"loss": torch.tensor(0.125)})
    # Step 1 went out with the first flush; the refused one never entered the buffer.
    assert [step for step, _ in s.sink.buffered("loss")] == [3, 4]
    s.flush()  # stacks the buffered tensors: one of shape (2,) would have broken it


@pytest.mark.parametrize("step", [-3, 0, 2**62])
def test_a_checkpoint_step_out_of_range_is_refused_at_the_call(tmp_path: Path, step: int) -> None:
    with pytest.raises(ValueError, match="step"):
        session(tmp_path).save_checkpoint({"w": 1}, step)
