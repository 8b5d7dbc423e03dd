"""Stall watchdog (real threads, a real rank-like subprocess that exits on a stall), the
non-finite loss policy on real autograd, and how both reasons reach the worker's decisions."""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from service.core import artifacts
from service.core.states import JobState
from worker.attempt import FailureReason, error_headline
from worker.decisions import HeldRun, decide_on_status
from worker.launchers.base import RunPhase, RunStatus
from worker.launchers.failure_text import earliest_rank_error
from worker.runtime.train.nonfinite import (
    NonFiniteLossError,
    NonFinitePolicy,
    gradients_finite,
    poison_gradients,
)
from worker.runtime.watchdog import StallReport, StallWatchdog, waiting_on_peers

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 20.0  # generous upper bound for a thread to react on a busy 2-core box


class Recorder:
    """Collects the watchdog's callbacks (``on_expired`` then ``on_stall``)."""

    def __init__(self) -> None:
        self.expired: list[StallReport] = []
        self.stalled: list[StallReport] = []
        self.fired = threading.Event()

    def on_expired(self, report: StallReport) -> None:
        self.expired.append(report)

    def on_stall(self, report: StallReport) -> None:
        self.stalled.append(report)
        self.fired.set()


def stuck_in_user_code(release: threading.Event) -> None:
    release.wait(WAIT_S)


def test_petted_watchdog_stays_quiet_and_fires_once_with_the_last_step() -> None:
    rec = Recorder()
    dog = StallWatchdog(0.3, rec.on_stall, on_expired=rec.on_expired, grace_s=0.2)
    dog.start(step=10)
    try:
        for step in range(11, 41):  # 30 steps of 25 ms: longer than the timeout in all
            time.sleep(0.025)
            dog.pet(step)
        assert not rec.expired and not rec.stalled, "a petted watchdog must not fire"
        stuck_in_user_code(rec.fired)  # the training thread stops stepping
        assert rec.fired.is_set(), "no pet for the timeout: the watchdog must fire"
    finally:
        dog.stop()
    [report] = rec.stalled
    assert len(rec.expired) == 1 and rec.expired[0].step == 40
    assert report.step == 40 and report.timeout_s == 0.3 and report.idle_s >= 0.3
    assert not report.waiting_on_peers
    assert "stuck_in_user_code" in report.stack, report.stack
    assert not dog.started and dog.fired == report


def test_pause_stops_the_clock_until_the_block_ends() -> None:
    rec = Recorder()
    dog = StallWatchdog(0.2, rec.on_stall, grace_s=0.1)
    dog.start()
    try:
        with dog.pause():  # e.g. a checkpoint write on a slow disk
            time.sleep(0.8)
        assert not rec.stalled, "paused time is not a stall"
        assert rec.fired.wait(WAIT_S), "after the pause the clock runs again"
    finally:
        dog.stop()


def test_a_rank_blocked_in_backward_gives_its_peer_a_grace_period_first() -> None:
    # DDP's gradient all_reduce blocks inside backward; a tensor hook that waits stands in
    # for a peer that never contributes (real autograd code on the stack).
    rec = Recorder()
    dog = StallWatchdog(0.3, rec.on_stall, on_expired=rec.on_expired, grace_s=0.5)
    release = threading.Event()
    seen_expired_before_stall: list[bool] = []

    def on_stall(report: StallReport) -> None:
        seen_expired_before_stall.append(bool(rec.expired))
        rec.on_stall(report)
        release.set()

    dog._on_stall = on_stall
    weight = torch.ones(3, requires_grad=True)
    weight.register_hook(lambda g: (release.wait(WAIT_S), g)[1])
    dog.start(step=5)
    try:
        (weight * 2).sum().backward()
    finally:
        dog.stop()
    assert rec.stalled, "a rank blocked on its peers still fails after the grace period"
    [report] = rec.stalled
    assert report.waiting_on_peers and report.step == 5
    assert len(rec.expired) == 1 and rec.expired[0].waiting_on_peers
    assert seen_expired_before_stall == [True], "stacks are dumped before the grace period"
    assert report.idle_s >= 0.3 + 0.5, "it waited the grace period before failing"


def test_a_pet_during_the_grace_period_cancels_the_stall() -> None:
    rec = Recorder()
    dog = StallWatchdog(0.3, rec.on_stall, on_expired=rec.on_expired, grace_s=3.0)
    weight = torch.ones(3, requires_grad=True)
    expired = threading.Event()
    rec_expired = rec.on_expired

    def on_expired(report: StallReport) -> None:
        rec_expired(report)
        expired.set()

    dog._on_expired = on_expired
    weight.register_hook(lambda g: (expired.wait(WAIT_S), g)[1])
    dog.start()
    try:
        (weight * 2).sum().backward()  # the peer answers once the deadline passed
        dog.pet(1)
        time.sleep(0.1)
        assert len(rec.expired) == 1 and not rec.stalled, "the peer answered in time"
    finally:
        dog.stop()
    assert not rec.stalled


STALLING_RANK = """
import logging, sys, threading, time
from functools import partial
from pathlib import Path
from worker.runtime.watchdog import StallWatchdog, dump_on_expiry, exit_on_stall

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
def stuck_in_user_code():
    time.sleep(120)

threading.Thread(target=time.sleep, args=(120,), name="data-loader", daemon=True).start()
dog = StallWatchdog(
    0.5,
    partial(exit_on_stall, artifact_dir=Path(sys.argv[1]), job_id=7, attempt=2, rank=1),
    on_expired=dump_on_expiry,
)
dog.start(step=12)
stuck_in_user_code()
"""


def test_a_stalled_rank_dumps_every_stack_writes_its_error_and_exits(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(STALLING_RANK), str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    log = proc.stderr
    assert "no step finished for" in log and "Python stacks of every thread follow" in log
    assert "stuck_in_user_code" in log, "the training thread's stack is in the log"
    assert log.count("hread 0x") >= 3, f"every thread's stack (main, loader, watchdog):\n{log}"
    error_file = artifacts.rank_error_path(tmp_path, 7, 2, 1)
    error = json.loads(error_file.read_text())
    assert error["reason"] == "stalled" and error["rank"] == 1
    assert error["message"].startswith("rank 1 finished no step for "), error
    assert "after step 12 (training.stall_timeout_s=0.5), not in a collective" in error["message"]
    assert "stuck_in_user_code" in error["traceback"]
    # What the worker makes of it: the job's error and its reason.
    text = earliest_rank_error(error_file.parent)
    assert text is not None and text.startswith("stalled: rank 1 finished no step for ")
    assert "stuck_in_user_code" in text and FailureReason.of(error["reason"]) == "stalled"


# -- failure reasons -----------------------------------------------------------------------------


def test_error_headlines_lead_with_the_reason_and_older_files_still_read() -> None:
    plain = {"rank": 1, "exc_type": "RuntimeError", "message": "boom", "reason": "error"}
    assert error_headline(plain) == "rank 1 failed: RuntimeError: boom"
    legacy = {"rank": 1, "exc_type": "RuntimeError", "message": "boom"}  # no reason field
    assert error_headline(legacy) == "rank 1 failed: RuntimeError: boom"
    nan = {"rank": 0, "exc_type": "NonFiniteLossError", "message": "at step 4",
           "reason": "nonfinite_loss"}  # fmt: skip
    assert error_headline(nan) == "nonfinite_loss: at step 4"
    # The policy reads the reason field, never the text: anything else reads as "error".
    assert FailureReason.of(nan["reason"]) == "nonfinite_loss"
    assert FailureReason.of("rank 1 failed: RuntimeError: stalled: no") == "error"
    assert FailureReason.of(None) == "error"


def _held(restarts: int = 0, max_restarts: int = 2) -> HeldRun:
    return HeldRun(job_id=4, attempt=1, state=JobState.RUNNING, restarts=restarts,
                   max_restarts=max_restarts)  # fmt: skip


def test_a_stall_is_retried_while_restarts_are_left_and_then_fails_stalled() -> None:
    error = "stalled: rank 1 finished no step for 60 s after step 9\n  File x"
    d = decide_on_status(_held(), RunStatus(RunPhase.FAILED, error))
    assert d is not None and d.transition.target == JobState.QUEUED
    assert (d.transition.reason or "").startswith("retry 1/2: stalled: rank 1")
    d = decide_on_status(_held(restarts=2), RunStatus(RunPhase.FAILED, error))
    assert d is not None and d.transition.target == JobState.FAILED
    assert (d.transition.reason or "").startswith("stalled: rank 1") and d.error == error


def test_a_nonfinite_loss_failure_is_not_retried() -> None:
    error = "nonfinite_loss: non-finite loss or gradients at step 4"
    failed = RunStatus(RunPhase.FAILED, error, failure=FailureReason.NONFINITE_LOSS)
    d = decide_on_status(_held(max_restarts=5), failed)
    assert d is not None and d.transition.target == JobState.FAILED, "a resume would replay it"
    assert d.transition.reason == error and d.error == error and not d.values


def test_a_failure_before_the_first_step_is_not_retried() -> None:
    setup = {"rank": 0, "exc_type": "EntrypointError", "message": "cannot import 'x'",
             "reason": "setup"}  # fmt: skip
    error = error_headline(setup)
    assert error == "setup: rank 0 failed before its first step: EntrypointError: cannot import 'x'"
    assert FailureReason.of(setup["reason"]) == "setup"
    failed = RunStatus(RunPhase.FAILED, error, failure=FailureReason.SETUP)
    d = decide_on_status(_held(max_restarts=5), failed)
    assert d is not None and d.transition.target == JobState.FAILED, "it would fail the same way"


def test_the_watchdog_knows_whether_a_step_finished() -> None:
    dog = StallWatchdog(60, lambda _report: None)
    try:
        dog.start(7)  # a resumed attempt about to run step 8
        assert not dog.stepped, "starting the clock is not a finished step"
        dog.pet()  # an eval batch
        assert not dog.stepped
        dog.pet(8)
        assert dog.stepped
    finally:
        dog.stop()
    custom = StallWatchdog(60, lambda _report: None)
    try:
        custom.step_finished(1)  # a custom loop's first ctx.report
        assert custom.stepped and custom.started
    finally:
        custom.stop()


# -- non-finite loss policy ----------------------------------------------------------------------


def _grads_after(loss_of: float) -> tuple[nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    loss = model(torch.ones(3, 4)).pow(2).mean()
    if not math.isfinite(loss_of):  # like regression's knob: the value NaN, the gradient real
        loss = loss + (torch.full_like(loss, loss_of) - loss.detach())
    poison_gradients(loss).backward()
    return model, loss


def test_poisoning_keeps_finite_gradients_bitwise_and_spreads_a_nan_loss() -> None:
    torch.manual_seed(0)
    plain = nn.Linear(4, 2)
    plain(torch.ones(3, 4)).pow(2).mean().backward()
    model, _ = _grads_after(1.0)
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
    assert gradients_finite(model.parameters())
    for bad in (math.nan, math.inf):
        model, _ = _grads_after(bad)
        assert not gradients_finite(model.parameters()), f"a {bad} loss must poison the grads"


def test_huge_but_finite_gradients_are_finite() -> None:
    layer = nn.Linear(4, 2)
    for p in layer.parameters():
        p.grad = torch.full_like(p, 1e30)  # its L2 norm overflows float32; no element does
    assert gradients_finite(layer.parameters())
    assert gradients_finite([nn.Parameter(torch.ones(2))]), "no gradient yet: nothing to skip"


def test_fail_raises_naming_the_step_and_skip_step_counts() -> None:
    model, loss = _grads_after(math.nan)
    with pytest.raises(NonFiniteLossError) as info:
        NonFinitePolicy("fail", rank=1).allows_step(7, loss, model.parameters())
    assert info.value.reason == "nonfinite_loss"
    assert "at step 7 (training.nonfinite_loss=fail); rank 1's loss was nan" in str(info.value)
    policy = NonFinitePolicy("skip_step")
    assert not policy.allows_step(7, loss, model.parameters())
    assert not policy.allows_step(8, loss, model.parameters()) and policy.skipped == 2
    finite_model, finite_loss = _grads_after(1.0)
    assert policy.allows_step(9, finite_loss, finite_model.parameters()) and policy.skipped == 2


# -- custom entrypoints ----------------------------------------------------------------------------


def test_train_context_calls_start_and_pet_the_watchdog(tmp_path: Path) -> None:
    from service.core.spec.model import JobSpec
    from worker.runtime.checkpoints.saver import NullCheckpointer
    from worker.runtime.distributed import DistContext
    from worker.runtime.metrics.buffer import NullSink
    from worker.runtime.signals import StopFlag
    from worker.runtime.train.context import TrainContext

    rec = Recorder()
    dog = StallWatchdog(0.3, rec.on_stall, grace_s=0.1)
    dist = DistContext(0, 0, 1, torch.device("cpu"), "ddp", None)
    spec = JobSpec.model_validate({"name": "c", "task": "examples.custom_loop:train"})
    ctx = TrainContext(spec=spec, dist=dist, sink=NullSink(dist), checkpointer=NullCheckpointer(),
                       stop=StopFlag(), api=None, artifact_dir=tmp_path, job_id=1, attempt=1,
                       watchdog=dog)  # fmt: skip
    try:
        time.sleep(0.6)  # the entrypoint builds its model: no clock before the first call
        assert not dog.started and not rec.stalled
        for step in range(1, 21):
            ctx.report(step, loss=1.0) if step % 2 else ctx.should_stop()
            time.sleep(0.03)
        ctx.save_checkpoint({"w": torch.ones(1)}, step=21)
        assert dog.started and not rec.stalled, "every ctx call counts as a finished step"
        assert rec.fired.wait(WAIT_S), "no ctx call for the timeout: stalled"
    finally:
        dog.stop()
    assert rec.stalled[0].step == 21


@pytest.mark.parametrize(
    ("step", "epoch", "name", "says"),
    [
        (0, None, "loss", "step 0 is outside 1.."),
        (1, -1, "loss", "epoch -1 is outside 0.."),
        (1, None, "x" * 101, "must be 1-100 characters"),
    ],
)
def test_ctx_report_refuses_a_point_that_could_not_be_stored(
    tmp_path: Path, step: int, epoch: int | None, name: str, says: str
) -> None:
    """A 0-based step (or a bad epoch or name) fails in the entrypoint's own loop with what to
    fix, instead of the point being dropped later by the rank-0 writer."""
    from service.core.spec.model import JobSpec
    from worker.runtime.checkpoints.saver import NullCheckpointer
    from worker.runtime.distributed import DistContext
    from worker.runtime.metrics.buffer import NullSink
    from worker.runtime.signals import StopFlag
    from worker.runtime.train.context import TrainContext

    dist = DistContext(0, 0, 1, torch.device("cpu"), "ddp", None)
    spec = JobSpec.model_validate({"name": "c", "task": "examples.custom_loop:train"})
    ctx = TrainContext(spec=spec, dist=dist, sink=NullSink(dist), checkpointer=NullCheckpointer(),
                       stop=StopFlag(), api=None, artifact_dir=tmp_path, job_id=1,
                       attempt=1)  # fmt: skip
    with pytest.raises(ValueError, match=says):
        ctx.report(step, epoch, **{name: 1.0})
    ctx.report(1, 0, loss=1.0)  # a good point still goes through
    ctx.report(torch.tensor(2), np.int64(0), loss=1.0)  # what loops compute their step with
    ctx.report(np.int64(3), loss=1.0)
    assert type(ctx.last_step) is int and ctx.last_step == 3


def _stack_through(*filenames: str) -> Any:
    """The frame at the top of a call chain whose functions live in ``filenames`` (outermost
    first), as if each were defined in that file."""
    code = "import sys\ndef f(nxt):\n    return nxt() if nxt else sys._getframe()\n"
    chain = None
    for name in reversed(filenames):
        scope: dict[str, Any] = {}
        exec(compile(code, name, "exec"), scope)
        inner, chain = chain, None
        chain = functools.partial(scope["f"], inner)
    assert chain is not None
    return chain()


@pytest.mark.parametrize(
    ("files", "waiting"),
    [
        # A warm rank runs under torch's elastic multiprocessing: not a collective by itself.
        (("torch/distributed/elastic/multiprocessing/api.py", "worker/runtime/main.py",
          "worker/tasks/regression.py"), False),
        (("torch/distributed/elastic/multiprocessing/api.py", "worker/runtime/main.py",
          "worker/runtime/train/trainer.py", "torch/autograd/__init__.py"), True),
        (("worker/runtime/main.py", "worker/runtime/distributed.py"), True),
        (("worker/runtime/main.py", "worker/tasks/regression.py"), False),
    ],
)  # fmt: skip
def test_only_frames_above_the_rank_entry_count_as_waiting_on_peers(
    files: tuple[str, ...], waiting: bool
) -> None:
    frame = _stack_through(*(f"/site/{f}" for f in files))
    assert waiting_on_peers(frame) is waiting
