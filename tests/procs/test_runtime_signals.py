"""The stop grace of a rank (real signals, in a child process): a stop signal that no step
boundary sees within DDPQ_STOP_GRACE_S ends the process with 128 + signum; one that a step
boundary sees leaves the graceful stop to the loop, however long it then takes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from worker.runtime.signals import StopFlag, stop_signal_handlers
    flag = StopFlag()
    with stop_signal_handlers(flag):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the handler runs; the grace thread starts counting
        if sys.argv[1] == "boundary":
            flag.seen_at_step_boundary()
        time.sleep(3)  # user code, far from any step boundary
    print("left normally", flush=True)
    """
)


@pytest.mark.parametrize(
    ("mode", "code", "out"), [("no-boundary", 143, ""), ("boundary", 0, "left normally")]
)
def test_a_stop_signal_unseen_by_a_step_boundary_exits_after_the_grace(
    mode: str, code: int, out: str
) -> None:
    env = {**os.environ, "DDPQ_STOP_GRACE_S": "0.5", "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    elapsed = time.monotonic() - t0
    assert done.returncode == code, done.stderr
    assert done.stdout.strip() == out
    if mode == "no-boundary":
        assert elapsed < 2.5, (
            f"the grace (0.5 s) should end it long before its 3 s sleep: {elapsed}"
        )
        assert "no step boundary within 0.5 s of received SIGTERM" in done.stderr, done.stderr
