"""What rank 0 tells the attempt API about its attempt, besides metrics: the step it resumed
from, what restoring cost, when training began, and how long checkpoint saves held the loop.

The resume step must reach the API before the attempt's first metric batch: the API then
moves earlier attempts' points of the steps this attempt trains again aside as superseded
(the store's metric history). ``AttemptFacts.begin`` hands it to the sink's writer,
which sends it before any later batch (``worker.runtime.metrics.sink.ApiSink.report_timeline``). The
goodput ledger (the store's attempts resource) reads the rest.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from service.core.wire.attempt import AttemptTimeline
from worker.runtime.metrics.buffer import Sink


class AttemptFacts:
    """One attempt's facts on one rank; only rank 0's sink sends them (a ``NullSink``
    ignores them). Training thread only.

    Attributes:
        resume_step: the checkpoint step agreed on at resume (0: from scratch; None: the
            loop never asked, see ``begin_at_report``).
        restore_s: seconds spent finding, verifying and loading the checkpoint.
        checkpoint_stall_s, checkpoint_saves: seconds the loop waited in checkpoint saves,
            and how many saves (all of them; the API is told only those a later point
            follows, see ``checkpoint_stall``).
        began: whether the attempt's start was told.
    """

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self.resume_step: int | None = None
        self.restore_s = 0.0
        self.checkpoint_stall_s = 0.0
        self.checkpoint_saves = 0
        self.began = False

    @contextmanager
    def restoring(self) -> Iterator[None]:
        """Time a part of the restore (finding, verifying, loading a checkpoint)."""
        start = time.monotonic()
        try:
            yield
        finally:
            self.restore_s += time.monotonic() - start

    def begin(self, resume_step: int) -> None:
        """Tell the attempt's start (once): it resumed from ``resume_step`` (0: from scratch)
        and its first step begins now."""
        if self.began:
            return
        self.began = True
        self.resume_step = resume_step
        self._sink.report_timeline(
            AttemptTimeline(
                resume_step=resume_step,
                restore_s=round(self.restore_s, 6),
                training_started_at_s=time.time(),
            )
        )

    def begin_at_report(self, step: int) -> None:
        """For a loop that never called ``begin``: at its first report (of ``step``), tell the
        resume step agreed on, or else ``step - 1`` (a loop that restored itself resumes
        there; one that starts over reports step 1, so 0)."""
        if not self.began:
            self.begin(self.resume_step if self.resume_step is not None else max(step - 1, 0))

    @contextmanager
    def checkpoint_stall(self) -> Iterator[None]:
        """Time one checkpoint save on the training thread (the snapshot, and the wait for the
        previous write) and tell the running total once a later point is flushed
        (``Sink.hold_timeline``): only saves inside the first-to-last step window stall
        training; the final save after the last step is the attempt's teardown."""
        start = time.monotonic()
        try:
            yield
        finally:
            self.checkpoint_stall_s += time.monotonic() - start
            self.checkpoint_saves += 1
            self._sink.hold_timeline(
                AttemptTimeline(
                    checkpoint_stall_s=round(self.checkpoint_stall_s, 6),
                    checkpoint_saves=self.checkpoint_saves,
                )
            )
