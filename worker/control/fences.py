"""The lease fence, as the worker loop applies it: a worker that cannot reach the control plane
keeps a job running only while its lease surely holds.

Each held run remembers when its lease was last renewed (``HeldRun.renewed_mono``: just before
the claim, adoption or heartbeat that renewed it was sent). Once ``renewed + lease_s - stop
budget`` has passed (``worker.decisions.decide_fences``), an attached launcher's ranks are
stopped and the run is forgotten, with no call to the control plane, so that the job never
runs here while the API requeues it for another worker. Detached jobs (Slurm) are adopted,
never requeued, while they run: they are never fenced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from worker.decisions import HeldRun, decide_fences, next_fence_deadline, stop_budget_for
from worker.launchers.base import GracefulCanceller, Launcher

log = logging.getLogger("worker.loop")

# How long an attached launcher's ``cancel`` may take when it does not say
# (``GracefulCanceller``): the local launcher's default grace, so the fence stops early enough.
DEFAULT_CANCEL_GRACE_S = 10.0


@dataclass
class LeaseFence:
    """The fence of one worker's runs on ``launcher``; ``clock`` is the loop's monotonic
    clock (seconds); ``detached``: the launcher's jobs outlive the worker (never fenced)."""

    launcher: Launcher
    clock: Callable[[], float]
    detached: bool = False
    # The longest one control-plane call may block (seconds): the fence is checked between
    # calls, so a call that hangs until its timeout delays it that much.
    call_timeout_s: float = 0.0
    cancel_grace_s: float = field(init=False)  # seconds one cancel may block

    def __post_init__(self) -> None:
        launcher = self.launcher
        grace = launcher.grace_s if isinstance(launcher, GracefulCanceller) else None
        self.cancel_grace_s = DEFAULT_CANCEL_GRACE_S if grace is None else grace

    def budget_s(self, lease_s: float, tick_s: float) -> float:
        """Seconds before a lease of ``lease_s`` could lapse by which a job this worker could
        not renew is stopped (``stop_budget_for``: the cancel's grace, a call that hangs until
        its timeout, a tick, a margin)."""
        return stop_budget_for(lease_s, self.cancel_grace_s + self.call_timeout_s, tick_s)

    def until_s(
        self, runs: Mapping[int, HeldRun], wait_s: float, *, lease_s: float, tick_s: float
    ) -> float:
        """``wait_s`` (seconds), cut so that a failing loop tries once more a tick before its
        runs' earliest fence deadline (an outage that ends by then costs nothing) and wakes
        by that deadline. A detached launcher's runs have none."""
        if self.detached:
            return wait_s
        budget_s = self.budget_s(lease_s, tick_s)
        deadline = next_fence_deadline(runs, lease_s=lease_s, budget_s=budget_s)
        if deadline is None:
            return wait_s
        left = deadline - self.clock()
        last_try = left - tick_s  # a try that fails within a tick does not delay the fence
        # Within a tenth of a tick of it, the try that just failed was that last one (and a
        # vanishing wait never repeats).
        return max(0.0, min(wait_s, last_try if last_try > tick_s / 10 else left))

    def stop_lapsing(
        self, runs: Mapping[int, HeldRun], *, lease_s: float, tick_s: float
    ) -> list[HeldRun]:
        """Stop the processes of every run whose lease was not renewed in time
        (``decide_fences``), all at once, and return those runs for the loop to forget: no
        call to the control plane, which may be unreachable. The API requeues each job once
        its lease lapses (or the next heartbeat that gets through does, as an orphan); either
        way the job never runs here and elsewhere at once. None for a detached launcher."""
        if self.detached:
            return []
        fences = decide_fences(
            runs, now=self.clock(), lease_s=lease_s, budget_s=self.budget_s(lease_s, tick_s),
            ahead_s=self.cancel_grace_s,
        )  # fmt: skip
        due = [runs[fence.job_id] for fence in fences]
        for run, fence in zip(due, fences, strict=True):
            log.warning(
                "job_id=%d attempt=%d lease not renewed for %.1f s (control plane unreachable "
                "or late): stopping its ranks so that it never runs twice; the API requeues it "
                "when the lease lapses (in %.1f s at the earliest)",
                run.job_id, run.attempt, fence.unrenewed_s, fence.lapses_in_s,
                extra={"job_id": run.job_id, "attempt": run.attempt},
            )  # fmt: skip
        self._cancel_at_once(due)
        return due

    def stop_all(self, runs: Mapping[int, HeldRun], *, why: str) -> list[HeldRun]:
        """Stop the processes of every run at once, within the grace and with no call to the
        control plane (``why``: logged per job), and return the runs for the loop to forget.
        A detached launcher's jobs are left running (returned all the same)."""
        held = list(runs.values())
        if not self.detached:
            for run in held:
                if run.handle is not None:
                    log.warning("job_id=%d attempt=%d stopping its ranks (%s)",
                                run.job_id, run.attempt, why)  # fmt: skip
            self._cancel_at_once(held)
        return held

    def _cancel_at_once(self, runs: list[HeldRun]) -> None:
        """Cancel the processes of ``runs`` side by side and wait for all: each cancel
        blocks up to the launcher's grace (SIGTERM, a stop checkpoint, SIGKILL), and every
        job must be stopped within its own budget, not one grace after another's. A cancel
        that fails is logged: retrying would fail alike, and the lease lapses regardless."""
        started = [(run, run.handle) for run in runs if run.handle is not None]
        if not started:
            return
        launcher = self.launcher
        stop = launcher.stop_within_grace if isinstance(launcher, GracefulCanceller) else None
        with ThreadPoolExecutor(len(started), thread_name_prefix="fence") as pool:
            futures = [(run, pool.submit(stop or launcher.cancel, h)) for run, h in started]
        for run, future in futures:
            if (exc := future.exception()) is not None:
                log.error("job_id=%d attempt=%d: could not stop its processes",
                          run.job_id, run.attempt, exc_info=exc)  # fmt: skip
