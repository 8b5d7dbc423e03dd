"""Where a job is and how fast it goes: the ``Progress`` snapshot a flush hands the sink, and
the clock that measures the pace between flushes (one for the built-in trainer and custom
loops alike)."""

from __future__ import annotations

import time

from worker.runtime.metrics.buffer import Progress


class ProgressClock:
    """Step pace between two flushes: samples/s and ETA over the last interval.

    ``samples_per_s`` and ``eta_s`` keep their last values while no step finished since the
    previous ``progress`` call (a flush at the same step).
    """

    def __init__(self, step: int = 0) -> None:
        self._mark = (time.monotonic(), step)
        self.samples_per_s: float | None = None
        self.eta_s: float | None = None

    @property
    def mark_step(self) -> int:
        """The step of the previous ``progress`` call (or of the start / ``restart``)."""
        return self._mark[1]

    def restart(self, step: int) -> None:
        """Measure from ``step`` now (after a resume: the steps before it took no time here)."""
        self._mark = (time.monotonic(), step)

    def progress(
        self,
        step: int,
        total_steps: int | None,
        epoch: int | None,
        *,
        samples_per_step: int | None = None,
    ) -> Progress:
        """The snapshot at ``step``; the pace over the steps since the previous call.

        ``samples_per_step`` (samples of one global step, all ranks) gives ``samples_per_s``;
        without it that stays None. ``eta_s`` (seconds) needs ``total_steps``.
        """
        now, (mark_s, mark_step) = time.monotonic(), self._mark
        steps = step - mark_step
        if steps > 0:
            step_s = max(now - mark_s, 1e-9) / steps
            if samples_per_step:
                self.samples_per_s = samples_per_step / step_s
            if total_steps is not None:
                self.eta_s = max(total_steps - step, 0) * step_s
        self._mark = (now, step)
        return Progress(step, total_steps, epoch, self.samples_per_s, self.eta_s)
