"""The stop flag of a rank and the signal handlers that raise it (SIGTERM, SIGINT, SIGUSR1).

A handler only sets a flag; the training loop reads it at step boundaries and turns it into a
collective decision (``distributed.StopVote``) so every rank stops at the same step.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

log = logging.getLogger(__name__)

# SIGTERM: cancel / shutdown by the launcher. SIGINT: Ctrl-C. SIGUSR1: Slurm's warning before
# preemption or the time limit (--signal=USR1@N). All three: checkpoint, flush, exit 128+signum.
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopFlag:
    """Set once when the rank should stop at the next step boundary; thread- and signal-safe."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signum: int | None = None
        self.reason: str | None = None

    def request(self, reason: str, signum: int | None = None) -> None:
        """Ask the loop to stop; the first reason wins."""
        if not self._event.is_set():
            self.signum, self.reason = signum, reason
            self._event.set()

    def is_set(self) -> bool:
        """Whether a stop was requested (by a signal or by the code)."""
        return self._event.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s`` seconds or until a stop is requested; returns is_set()."""
        return self._event.wait(timeout_s)


class StopRequested(Exception):
    """Raised where a rank cannot reach a step boundary (e.g. an injected hang) to stop now."""


@contextmanager
def stop_signal_handlers(flag: StopFlag) -> Iterator[None]:
    """Install handlers that set ``flag`` for ``STOP_SIGNALS``; restore the old ones on exit.

    Off the main thread (Python allows handlers only there) it installs nothing and logs it.
    """
    if threading.current_thread() is not threading.main_thread():
        log.warning("not on the main thread: stop signals are not handled by the runtime")
        yield
        return

    def _handler(signum: int, _frame: FrameType | None) -> None:
        flag.request(f"received {signal.Signals(signum).name}", signum)

    previous = {sig: signal.signal(sig, _handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
