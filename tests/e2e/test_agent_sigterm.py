"""A SIGTERM that reaches a warm rank between its fork (from ``worker.runtime.agent``'s fork
server, which ignores SIGTERM) and ``rank_main`` restoring it must not be lost: a cancel
right as the ranks start would otherwise wait for the launcher's SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

# Runs in a fresh interpreter: the fork server is configured as the agent configures it.
SCRIPT = textwrap.dedent(
    """
    import multiprocessing
    import os
    import signal
    import sys
    import time

    from worker.runtime import agent


    def child():
        # A SIGTERM arriving before the rank's entry runs (as from a cancel at launch).
        os.kill(os.getpid(), signal.SIGTERM)
        agent.restore_sigterm()
        time.sleep(60)  # only reached when the SIGTERM was lost


    if __name__ == "__main__":
        multiprocessing.set_forkserver_preload(list(agent.PRELOAD))
        proc = multiprocessing.get_context("forkserver").Process(target=child)
        proc.start()
        proc.join(120)
        print("exitcode", proc.exitcode, flush=True)
        if proc.exitcode is None:
            proc.kill()
    """
)


@pytest.mark.slow
def test_sigterm_before_rank_entry_is_not_lost(tmp_path: os.PathLike[str]) -> None:
    script = os.path.join(tmp_path, "fork_sigterm.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    out = subprocess.run(
        [sys.executable, script], capture_output=True, text=True, timeout=180, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert f"exitcode {-signal.SIGTERM}" in out.stdout, (out.stdout, out.stderr[-2000:])
