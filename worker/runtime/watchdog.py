"""Stall detection inside a rank: a watchdog thread that every finished step pets.

No step finished for ``training.stall_timeout_s`` seconds → the rank writes every thread's
Python stack to its log (stderr is the rank log, see ``rank_output``), writes its error file
with reason ``stalled`` and exits 1 at once (``os._exit``: the training thread is stuck, so
nothing can unwind it). torchrun then tears down the other ranks (under Slurm, their
collectives with the dead rank fail); the job's error is the earliest error file.

The clock starts when the first step starts (``start``), not at process start: the process
group, the task's data and model and a checkpoint load are done by then, so only the first
step's own warm-up (compilation, first batches) counts, against the same timeout.

Which rank is named: every rank of a job blocked by one hung rank stops finishing steps at
about the same moment. A rank whose training thread waits inside torch.distributed /
autograd (a collective, DDP's gradient all_reduce) or ddpq's stop vote waits
``PEER_WAIT_GRACE_S`` longer before it fires, so the rank that really hung reports first.
A hang that holds the GIL (a stuck C call that never releases it) stops this thread too and
is not detected; the job's ``timeout_min`` still ends it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TextIO

from worker.attempt import ExitCode, FailureReason, now_s, write_rank_error
from worker.processes import exit_now

log = logging.getLogger(__name__)

# Extra seconds a rank that waits on its peers gives the stalled peer to report first.
PEER_WAIT_GRACE_S = 10.0
# Code of the training thread that means "waiting for other ranks" (path fragments).
_PEER_WAIT_CODE = (
    f"torch{os.sep}distributed{os.sep}",
    f"torch{os.sep}autograd{os.sep}",
    f"worker{os.sep}runtime{os.sep}distributed.py",
)
# Where a rank's own code starts (run_rank); what called it does not count.
_RANK_ENTRY_FILE = f"worker{os.sep}runtime{os.sep}main.py"


class StallError(RuntimeError):
    """No step finished for ``stall_timeout_s`` (never raised: the watchdog exits the rank)."""

    reason = FailureReason.STALLED


@dataclass(frozen=True)
class StallReport:
    """What the watchdog saw when it fired.

    ``step``: the last finished step (0: none yet this attempt). ``idle_s``: seconds since
    it. ``stack``: the training thread's Python stack, formatted. ``waiting_on_peers``: the
    training thread was inside a collective.
    """

    step: int
    idle_s: float
    timeout_s: float
    stack: str
    waiting_on_peers: bool


StallHandler = Callable[[StallReport], None]


def waiting_on_peers(frame: FrameType | None) -> bool:
    """Whether the stack ending in ``frame`` is inside torch.distributed, autograd (DDP's
    gradient all_reduce runs in ``backward``) or ddpq's collectives.

    Only the frames above the rank's entry (``worker/runtime/main.py``) count: below it lies
    whatever started the rank, e.g. torch's elastic multiprocessing, which runs a warm rank
    (``worker.runtime.agent``) from inside ``torch/distributed/``.
    """
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.endswith(_RANK_ENTRY_FILE):
            return False
        if any(part in filename for part in _PEER_WAIT_CODE):
            return True
        frame = frame.f_back
    return False


class StallWatchdog:
    """Fires ``on_stall`` once when no ``pet`` came for ``timeout_s`` seconds after ``start``.

    At the deadline it first calls ``on_expired`` (the production one dumps every stack, so
    each rank of a stalled job leaves its stacks, even one that is torn down during its
    grace period); a rank waiting on its peers then waits ``grace_s`` more and fires only if
    still no ``pet`` came.

    ``pet`` is two attribute writes (no lock, no syscall): call it after every step. The
    thread sleeps until the deadline of the latest pet, so it wakes about once per
    ``timeout_s``. ``pause`` suspends the clock around work that is legitimately long and
    has no steps (e.g. a final checkpoint wait); nothing detects a hang inside it.
    """

    def __init__(
        self,
        timeout_s: float,
        on_stall: StallHandler,
        *,
        on_expired: StallHandler | None = None,
        grace_s: float = PEER_WAIT_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_s, self.grace_s = float(timeout_s), float(grace_s)
        self._on_stall, self._on_expired, self._clock = on_stall, on_expired, clock
        self._last_s = 0.0
        self._step = 0
        self._paused = 0
        self._thread: threading.Thread | None = None
        self._target_ident: int | None = None
        self._done = threading.Event()
        self.fired: StallReport | None = None
        # A step finished in this attempt (a pet with a step): failures before it are
        # "setup" failures, not retried.
        self.stepped = False

    @property
    def started(self) -> bool:
        """Whether the clock is running (``start`` was called and ``stop`` was not)."""
        return self._thread is not None and not self._done.is_set()

    def start(self, step: int = 0) -> None:
        """Start the clock now (the first step is starting) from ``step``; watch the calling
        thread. A second call only pets."""
        if self._thread is not None:
            self.pet(step)
            return
        self._last_s, self._step = self._clock(), step
        self._target_ident = threading.get_ident()
        self._thread = threading.Thread(target=self._watch, name="ddpq-stall-watchdog", daemon=True)
        self._thread.start()

    def pet(self, step: int | None = None) -> None:
        """A step finished (or other progress was made): restart the clock."""
        self._last_s = self._clock()
        if step is not None:
            self._step = step
            self.stepped = True

    def step_finished(self, step: int) -> None:
        """A step finished (custom entrypoints' ``ctx`` calls): start the clock on the first
        call, pet on every call."""
        if self._thread is None:
            self.start(step)
        self.pet(step)  # start() alone would leave ``stepped`` unset

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Stop the clock inside the block; it restarts (a pet) when the block ends."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.pet()

    def stop(self) -> None:
        """Stop watching (idempotent); waits for the thread unless called from it."""
        self._done.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _watch(self) -> None:
        graced_at: float | None = None  # the pet time whose deadline got a grace period
        while not self._done.is_set():
            last_s = self._last_s
            wait_s = last_s + self.timeout_s - self._clock()
            if self._paused:
                wait_s = self.timeout_s
            elif wait_s <= 0:
                report = self._report()
                if graced_at != last_s and self._on_expired is not None:
                    self._on_expired(report)
                if report.waiting_on_peers and graced_at != last_s:
                    graced_at = last_s
                    wait_s = self.grace_s
                else:
                    self.fired = report
                    self._done.set()
                    self._on_stall(report)
                    return
            self._done.wait(max(wait_s, 0.01))

    def _report(self) -> StallReport:
        frame = sys._current_frames().get(self._target_ident or -1)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)\n"
        return StallReport(
            step=self._step,
            idle_s=self._clock() - self._last_s,
            timeout_s=self.timeout_s,
            stack=stack,
            waiting_on_peers=waiting_on_peers(frame),
        )


class NullWatchdog(StallWatchdog):
    """A watchdog that never fires and starts no thread (stall detection off)."""

    def __init__(self) -> None:
        super().__init__(math.inf, lambda _report: None)

    def start(self, step: int = 0) -> None:
        """Only records ``step``."""
        self._step = step


def stall_message(report: StallReport, rank: int, job_id: int | None = None) -> str:
    """The job's error text after ``stalled: ``, naming the rank, step and timeout, and the
    command that shows the stacks."""
    where = (
        "waiting for other ranks in a collective"
        if report.waiting_on_peers
        else "not in a collective"
    )
    after = f"after step {report.step}" if report.step else "in its first step"
    return (
        f"rank {rank} finished no step for {report.idle_s:.0f} s {after} "
        f"(training.stall_timeout_s={report.timeout_s:g}), {where}; the Python stacks of "
        f"all its threads are in its log (`ddpq logs {job_id if job_id is not None else '<id>'} "
        f"--rank {rank}`)"
    )


def dump_all_stacks(stream: TextIO) -> None:
    """Every thread's Python stack to ``stream`` (faulthandler's format when ``stream`` has a
    file descriptor, else formatted by ``traceback``)."""
    import faulthandler

    with contextlib.suppress(Exception):
        stream.flush()
    try:
        faulthandler.dump_traceback(file=stream, all_threads=True)
        return
    except (AttributeError, ValueError, OSError):
        pass  # no usable file descriptor (e.g. a test's captured stream)
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        stream.write(f"Thread {names.get(ident, ident)} (most recent call last):\n")
        stream.write("".join(traceback.format_stack(frame)))
    stream.flush()


def dump_on_expiry(report: StallReport) -> None:
    """The production ``on_expired``: say so in the log and dump every thread's stack there."""
    log.error(
        "no step finished for %.0f s after step %d (training.stall_timeout_s=%g)%s; "
        "Python stacks of every thread follow",
        report.idle_s,
        report.step,
        report.timeout_s,
        f", waiting for other ranks: {PEER_WAIT_GRACE_S:g} s more before failing"
        if report.waiting_on_peers
        else "",
    )
    dump_all_stacks(sys.stderr)


def exit_on_stall(
    report: StallReport, *, artifact_dir: Path, job_id: int, attempt: int, rank: int
) -> None:
    """The production ``on_stall``: write ``error-rank-<rank>.json`` with reason ``stalled``
    and exit 1 without unwinding (the training thread is stuck)."""
    message = stall_message(report, rank, job_id)
    stack = f"Stack of the training thread (most recent call last):\n{report.stack}"
    try:
        log.error("stalled: %s", message)
        write_rank_error(
            artifact_dir,
            job_id,
            attempt,
            rank,
            StallError(message),
            now_s(),
            traceback_text=stack,
        )
    finally:
        # No logging.shutdown: the stuck training thread may hold a handler's lock.
        exit_now(ExitCode.FAILED, shutdown_logging=False)
