"""A command job's rank: the user's script, run as torchrun would run it, inside ddpq's rank.

torchrun starts ``python train.py args`` in every rank with its standard environment (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). ddpq's ranks are
``python -m worker.runtime`` (forked warm, see ``worker.runtime.agent``), so the script runs
here with ``runpy``, exactly as ``python`` would run it: ``__name__ == "__main__"``,
``sys.argv`` the command, ``sys.path[0]`` the script's folder (the working directory for
``-m``), the workspace as the working directory. The script calls ``init_process_group``
itself, from that environment; ddpq does not initialise the process group for it.

Running in ddpq's process, rather than as a child, keeps what a rank already has: the output
goes to the rank's log, a raised exception becomes the rank's error file with its traceback
(so a failure names the rank and the exception), and a stop signal ends it after the grace
(``worker.runtime.signals``).
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
from pathlib import Path

from service.core.errors import DdpqError
from service.core.spec.model import JobSpec
from worker.attempt import ExitCode, FailureReason, mark_finished, write_result
from worker.runtime.attempt_client import AttemptClient
from worker.runtime.topology import RankEnv
from worker.runtime.workspace import materialize

log = logging.getLogger(__name__)


class ScriptExitError(DdpqError):
    """The user's script ended with ``sys.exit(code)`` for a code other than 0 or None."""

    status_code = 500
    code = "script_exit"
    reason = FailureReason.ERROR

    def __init__(self, code: object) -> None:
        self.exit_code = code
        what = f"exit code {code}" if isinstance(code, int) else f"exit message {code!r}"
        super().__init__(f"the script called sys.exit with {what}")


def run_command(spec: JobSpec, env: RankEnv, api: AttemptClient, artifact_dir: Path) -> int:
    """Fetch the workspace (once per host), then run ``spec.command`` in it.

    Returns:
        ``ExitCode.OK`` when the script returned or exited with 0 (rank 0 writes result.json
        with no metrics: a script that reports nothing still succeeds).
    Raises:
        WorkspaceFetchError: the workspace could not be brought onto this host.
        ScriptExitError: ``sys.exit`` with a non-zero code.
        Exception: whatever the script raised (the caller records it as the rank's error).
    """
    assert spec.command is not None, "run_command is for command jobs"
    root = materialize(api, artifact_dir, env.job_id, env.attempt)
    os.chdir(root)
    command = list(spec.command)
    log.info("running %s in %s", " ".join(command), root)
    try:
        _run_python(root, command)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise ScriptExitError(exc.code) from None
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    mark_finished(artifact_dir, env.job_id, env.attempt, env.rank)
    if env.rank == 0:
        write_result(
            artifact_dir, env.job_id, env.attempt, step=0, final_metrics={}, checkpoint=None
        )
    return ExitCode.OK


def _run_python(root: Path, command: list[str]) -> None:
    """``python <command>`` in this process, as the interpreter's own command line would."""
    if command[0] in ("-m", "--module"):
        module, args = command[1], command[2:]
        sys.argv = [module, *args]  # runpy puts the module's file in argv[0]
        sys.path.insert(0, str(root))
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script = root.joinpath(*command[0].split("/"))
    sys.argv = [str(script), *command[1:]]
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")
