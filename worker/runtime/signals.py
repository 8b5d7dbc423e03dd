"""The stop flag of a rank and the signal handlers that raise it (SIGTERM, SIGINT, SIGUSR1).

A handler only sets a flag; the training loop reads it at step boundaries and turns it into a
collective decision (``distributed.StopVote``) so every rank stops at the same step. That
graceful path is bounded: a rank that reaches no step boundary within ``DDPQ_STOP_GRACE_S``
seconds of the signal (busy in user code, blocked before its first collective) leaves at once
with ``128 + signum``, as if it had no handler, instead of holding the attempt open until its
launcher's SIGKILL.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import FrameType

from worker.attempt import STOP_GRACE_S, signal_exit
from worker.processes import exit_now

log = logging.getLogger(__name__)

# SIGTERM: cancel / shutdown by the launcher. SIGINT: Ctrl-C. SIGUSR1: Slurm's warning before
# preemption or the time limit (--signal=USR1@N). All three: checkpoint, flush, exit 128+signum.
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# Seconds from a stop signal to the first step boundary that sees it, else the rank exits.
DEFAULT_STOP_GRACE_S = 5.0


def stop_grace_s(environ: Mapping[str, str] | None = None) -> float:
    """``DDPQ_STOP_GRACE_S`` (seconds, > 0), else ``DEFAULT_STOP_GRACE_S``."""
    raw = (os.environ if environ is None else environ).get(STOP_GRACE_S, "")
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_STOP_GRACE_S
    return value if value > 0 else DEFAULT_STOP_GRACE_S


class StopFlag:
    """Set once when the rank should stop at the next step boundary; thread- and signal-safe."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._seen = threading.Event()  # a step boundary saw the request
        self.signum: int | None = None
        self.reason: str | None = None
        self._last_words: list[Callable[[], None]] = []

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

    def seen_at_step_boundary(self) -> bool:
        """Called by the loop at every step boundary: a pending request is then on its way to
        a graceful stop (checkpoint, flush), so the grace no longer applies. Returns
        is_set()."""
        if self._event.is_set():
            self._seen.set()
        return self._event.is_set()

    def wait_seen(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for a step boundary to see the request."""
        return self._seen.wait(timeout_s)

    def at_forced_exit(self, last_words: Callable[[], None]) -> None:
        """Have the grace thread call ``last_words`` before it ends a rank that did not stop
        on its own (e.g. hand over the metrics reported so far). It runs on that thread
        while the main thread is still in the user's code: it must take bounded time and
        touch only what is safe to touch from another thread."""
        self._last_words.append(last_words)

    def say_last_words(self) -> None:
        """Call what ``at_forced_exit`` registered, newest first; a failure is logged."""
        for last_words in reversed(self._last_words):
            try:
                last_words()
            except Exception:
                log.exception("before a forced exit")


def _exit_unless_seen(flag: StopFlag, grace_s: float, done: threading.Event) -> None:
    """The grace thread: once a signal raised ``flag``, exit ``128 + signum`` if no step
    boundary saw it within ``grace_s`` seconds (``done``: the handlers were removed)."""
    while not done.is_set():
        if not flag.wait(0.5):
            continue
        if flag.signum is None:
            return  # stopped by the code (fenced off): the first reason wins, no signal to bound
        if flag.wait_seen(grace_s) or done.is_set():
            return
        log.warning("no step boundary within %.1f s of %s: exiting now", grace_s, flag.reason)
        flag.say_last_words()
        # Without logging's shutdown: the main thread may hold a handler's lock.
        exit_now(signal_exit(flag.signum), shutdown_logging=False)


class StopRequested(Exception):
    """Raised where a rank cannot reach a step boundary (e.g. an injected hang) to stop now."""


def install_stop_handlers(flag: StopFlag) -> Callable[[], None] | None:
    """Install handlers that set ``flag`` for ``STOP_SIGNALS`` and start the grace thread.

    Returns:
        A function that restores the previous handlers and ends the grace thread's watch;
        None off the main thread (Python allows handlers only there: nothing installed, and
        that is logged).
    """
    if threading.current_thread() is not threading.main_thread():
        log.warning("not on the main thread: stop signals are not handled by the runtime")
        return None

    def _handler(signum: int, _frame: FrameType | None) -> None:
        flag.request(f"received {signal.Signals(signum).name}", signum)

    previous = {sig: signal.signal(sig, _handler) for sig in STOP_SIGNALS}
    done = threading.Event()
    grace = threading.Thread(
        target=_exit_unless_seen, args=(flag, stop_grace_s(), done), name="ddpq-stop-grace",
        daemon=True,
    )  # fmt: skip
    grace.start()

    def restore() -> None:
        done.set()
        flag.seen_at_step_boundary()  # the rank is leaving on its own: release a pending grace
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore


@contextmanager
def stop_signal_handlers(flag: StopFlag) -> Iterator[None]:
    """``install_stop_handlers`` for the block; the old handlers are restored on exit."""
    restore = install_stop_handlers(flag)
    try:
        yield
    finally:
        if restore is not None:
            restore()
