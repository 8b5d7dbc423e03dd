"""A command job's rank: the user's script, started as torchrun starts it, watched by ddpq.

torchrun starts ``python train.py args`` in every rank with its standard environment (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). ddpq's rank
(``python -m worker.runtime``, forked warm by ``worker.runtime.agent``) first brings the
job's workspace onto this host (``worker.runtime.script.workspace``), then starts exactly that:
``python <command>`` in the workspace, with the rank's environment, its output going to the
rank's log. The script is its own process, as under torchrun, so nothing of ddpq's reaches
it: not its imported packages (a project may have its own ``worker`` or ``service``), not its
logging set-up, not its signal handlers; ``sys.argv`` and tracebacks are the script's own.

The rank stays as the script's supervisor:
- a stop signal (cancel, preemption, worker shutdown) reaches the script from the launcher
  (``_wait`` passes it on only when the rank alone got it), and the rank then exits
  ``128 + signum`` whatever the script returns (a script that saves and exits 0 on SIGTERM
  has not finished its job);
- a non-zero exit becomes the rank's error file: the exception and the last traceback lines
  parsed from the script's stderr (``parse_traceback``), else the exit code or signal;
- an exit 0 leaves the rank's ``finished`` marker (its peers' "connection closed" afterwards
  are not blamed on it), and rank 0 writes ``result.json``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from service.core.artifacts import checkpoint_dir
from service.core.errors import DdpqError
from service.core.spec.model import JobSpec
from worker.attempt import (
    RESUMED_FROM_STEP,
    ExitCode,
    FailureReason,
    mark_finished,
    write_result,
)
from worker.runtime.attempt_client import AttemptClient
from worker.runtime.script.workspace import materialize
from worker.runtime.signals import StopFlag, stop_grace_s
from worker.runtime.topology import RankEnv

log = logging.getLogger(__name__)
# How often the rank looks at the script and its stop flag (seconds).
POLL_S = 0.1
# Most bytes of the script's log tail read back to find its traceback.
TAIL_BYTES = 256_000
# Seconds the rank waits, once the script exited, for the rest of its stderr (a child of the
# script may keep the pipe open; then its tail so far is what counts).
RELAY_WAIT_S = 2.0
TRACEBACK_HEADER = "Traceback (most recent call last):"
# Lines of the script's output kept as the "traceback" of an exit without one.
LAST_LINES = 20
# The most of the script's last stderr line the error message quotes (characters).
LAST_LINE_CHARS = 300
_EXCEPTION_RE = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)(?::\s?(?P<message>.*))?$")
# torch.distributed prefixes an uncaught exception's lines with the rank (``[rank1]: ``).
_RANK_PREFIX_RE = re.compile(r"^\[rank\d+\]: ?", re.M)
# What Python's faulthandler prints on a fatal signal (its C source, faulthandler.c and
# traceback.c): a header, then each thread's frames, innermost first.
FAULT_HEADER = "Fatal Python error: "
_CURRENT_THREAD = "Current thread "
# How the error says a fatal signal came with no Python code running.
EXITING = "with no Python code running (as while Python exits after the script's last line)"
_FRAME_RE = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>\S+)$', re.M)


class ScriptFailedError(DdpqError):
    """The user's script exited non-zero. ``exc_type`` and ``message`` are the exception its
    traceback named (``"ValueError"``, ``"bad shape"``), else ``ScriptExit`` and its exit code
    or signal; ``traceback_text`` the traceback's lines as the script printed them."""

    status_code = 500
    code = "script_failed"
    reason = FailureReason.ERROR

    def __init__(self, exc_type: str, message: str, traceback_text: str) -> None:
        self.exc_type, self.message, self.traceback_text = exc_type, message, traceback_text
        super().__init__(message)


@dataclass(frozen=True)
class FaultDump:
    """Python's faulthandler dump of a script killed by a fatal signal: ``before`` (the
    output up to it, where a C++ library's own last words stand), ``text`` (the dump, without
    its list of extension modules), ``where``, the innermost Python frame of the thread
    that got the signal (``"train.py:70 in main"``; None when that thread ran no Python), and
    ``python_ran``: whether any thread stood in Python code. None did when the signal came
    while the interpreter exited after the script's last line (a library's teardown: torch's
    gloo has been seen to abort there, under torchrun alike)."""

    before: str
    text: str
    where: str | None
    python_ran: bool


def parse_fault_dump(text: str) -> FaultDump | None:
    """The last faulthandler dump in ``text`` (a rank's output), None without one."""
    start = text.rfind(FAULT_HEADER)
    if start < 0:
        return None
    dump = text[start:].split("\nExtension modules:", 1)[0].rstrip()
    current = dump.find(_CURRENT_THREAD)
    frame = _FRAME_RE.search(dump, current) if current >= 0 else None
    where = None
    if frame is not None:
        where = f"{os.path.basename(frame['file'])}:{frame['line']} in {frame['func']}"
    return FaultDump(text[:start], dump, where, _FRAME_RE.search(dump) is not None)


@dataclass(frozen=True)
class ParsedTraceback:
    """The last Python traceback in a text: the exception's type and message, and the
    traceback's lines from its header to the exception line."""

    exc_type: str
    message: str
    text: str


def parse_traceback(text: str) -> ParsedTraceback | None:
    """The last ``Traceback (most recent call last):`` block of ``text`` (a rank's output),
    with the exception line that ends it: the first line after the header that is not a
    frame line (frames and their source lines are indented). torch's ``[rankN]: `` line
    prefixes are dropped first. None without a traceback."""
    text = _RANK_PREFIX_RE.sub("", text)
    start = text.rfind(TRACEBACK_HEADER)
    if start < 0:
        return None
    lines = text[start:].splitlines()
    for i, line in enumerate(lines[1:], start=1):
        if not line or line[0].isspace():
            continue
        match = _EXCEPTION_RE.match(line)
        if match is None:
            return None
        return ParsedTraceback(
            match["type"], (match["message"] or "").strip(), "\n".join(lines[: i + 1])
        )
    return None


def run_command(
    spec: JobSpec, env: RankEnv, api: AttemptClient, artifact_dir: Path, stop: StopFlag
) -> int:
    """Fetch the workspace (once per host), run ``python <spec.command>`` in it, and turn its
    end into the rank's.

    Returns:
        ``ExitCode.OK`` when the script exited 0 (rank 0 writes result.json with no metrics:
        a script that reports nothing still succeeds); ``128 + signum`` when a stop signal
        came, whatever the script did then.
    Raises:
        WorkspaceFetchError: the workspace could not be brought onto this host.
        ScriptFailedError: the script exited non-zero (or was killed) without a stop signal.
    """
    assert spec.command is not None, "run_command is for command jobs"
    child_env = script_env(os.environ)
    follower = None
    if spec.checkpoints is None and spec.metrics is None:
        root = materialize(api, artifact_dir, env.job_id, env.attempt)
    else:  # the script's own files to follow (imported only for such jobs)
        from worker.runtime.script import follow

        restore = functools.partial(
            follow.restore, spec, api, artifact_dir, env.job_id, env.attempt
        )
        root = materialize(api, artifact_dir, env.job_id, env.attempt, then=restore)
        restored = follow.restored_step(artifact_dir, env.job_id, env.attempt)
        if restored is not None:
            child_env[RESUMED_FROM_STEP] = str(restored)
        if env.rank == 0:
            follower = follow.ScriptFollower(spec, env, artifact_dir, root, stop, restored)
    # DDPQ_CHECKPOINT_DIR: the job's directory on this host, kept across its attempts here.
    checkpoint_dir(artifact_dir, env.job_id).mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    log.info("running python %s in %s", " ".join(spec.command), root)
    code: int | None = None
    relay: StderrRelay | None = None
    try:
        if follower is not None:
            follower.start()
        child = subprocess.Popen(  # stdout: the rank's own, i.e. its log; stderr: relayed
            [sys.executable, *spec.command], cwd=root, env=child_env,
            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        assert child.stderr is not None
        relay = StderrRelay(child.stderr.fileno())
        if follower is not None:
            follower.watch(child)
        code = _wait(child, stop)
    finally:
        if follower is not None:
            follower.close(code)
        tail = relay.finish() if relay is not None else ""
    if stop.is_set() and stop.signum is not None:
        log.warning("stopped (%s); the script exited with %s", stop.reason, code)
        return 128 + stop.signum
    if code == 0:
        mark_finished(artifact_dir, env.job_id, env.attempt, env.rank)
        if env.rank == 0:
            write_result(
                artifact_dir, env.job_id, env.attempt, step=0, final_metrics={}, checkpoint=None
            )
        return ExitCode.OK
    raise _failure(code, tail)


def script_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The script's environment: the rank's ``environ`` with Python's faulthandler on, so a
    script killed by a fatal signal (a C++ library's abort, a segfault) prints where its Python
    threads stood, and the job's error names the line (``_failure``). It prints only on such
    signals; the script's own ``PYTHONFAULTHANDLER`` wins."""
    env = dict(environ)
    env.setdefault("PYTHONFAULTHANDLER", "1")
    return env


def _wait(child: subprocess.Popen[bytes], stop: StopFlag) -> int:
    """The script's exit code (negative: the signal that killed it).

    A stop signal reaches the script from the launcher itself (the local launcher signals
    every process group of the attempt's tagged processes, Slurm every process of the step),
    so the rank passes it on only when the script still runs ``DDPQ_STOP_GRACE_S`` seconds
    later (the rank alone was signalled): a script that saves on SIGTERM gets it once. The
    rank itself waits for the script meanwhile; the launcher's SIGKILL bounds that wait."""
    pass_on_at: float | None = None
    while True:
        try:
            return child.wait(POLL_S)
        except subprocess.TimeoutExpired:
            if not stop.is_set() or pass_on_at == math.inf:
                continue
            if pass_on_at is None:
                stop.seen_at_step_boundary()  # the script stops now: no grace exit for us
                pass_on_at = time.monotonic() + stop_grace_s()
            elif time.monotonic() >= pass_on_at:
                sig = stop.signum if stop.signum is not None else signal.SIGTERM
                log.warning("the script still runs %.1f s after the stop: passing on %s",
                            stop_grace_s(), signal.Signals(sig).name)  # fmt: skip
                child.send_signal(sig)
                pass_on_at = math.inf


class StderrRelay:
    """Copies the script's stderr into the rank's own (its log) as it comes, keeping the last
    ``TAIL_BYTES`` to find the script's traceback in.

    The rank's log is written by the local worker from a pipe, a moment after the bytes
    leave, and capped: the rank cannot read its traceback back from the file, so it keeps
    its own copy of the newest bytes.
    """

    def __init__(self, fd: int, out_fd: int = 2) -> None:
        self._fd, self._out_fd = fd, out_fd
        self._tail = bytearray()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._copy, name="script-stderr", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        while True:
            try:
                data = os.read(self._fd, 65536)
            except OSError:
                return
            if not data:
                return
            with contextlib.suppress(OSError):  # a closed log never stops the script
                _write_all(self._out_fd, data)
            with self._lock:
                self._tail += data
                del self._tail[:-TAIL_BYTES]

    def finish(self, timeout_s: float = RELAY_WAIT_S) -> str:
        """The last ``TAIL_BYTES`` of the script's stderr, once it reached its end (every
        holder closed it) or after ``timeout_s`` seconds (a child of the script keeps it)."""
        self._thread.join(timeout_s)
        with self._lock:
            return bytes(self._tail).decode("utf-8", errors="replace")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _failure(code: int, output: str) -> ScriptFailedError:
    """The rank's error for a script that exited ``code``: its traceback when it printed
    one, else the exit code or the signal."""
    parsed = parse_traceback(output)
    if parsed is not None:
        return ScriptFailedError(parsed.exc_type, parsed.message, parsed.text)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        how = f"the script was killed by {name}"
    else:
        how = f"the script exited with code {code}"
    fault = parse_fault_dump(output)
    if fault is not None:
        output = fault.before
        if fault.where is not None:
            how += f" at {fault.where}"
        elif not fault.python_ran:
            how += f" {EXITING}"
    lines = output.rstrip().splitlines()
    last = fault.text if fault is not None else "\n".join(lines[-LAST_LINES:])
    message = f"{how} without a Python traceback"
    # The job's error is all most users read: an argparse usage error or a shell's "command
    # not found" is in the script's last stderr line, and would else be only in its log.
    said = next((line.strip() for line in reversed(lines) if line.strip()), "")
    if said:
        cut = said if len(said) <= LAST_LINE_CHARS else said[: LAST_LINE_CHARS - 1] + "…"
        message += f"; its last line on stderr: {cut}"
    return ScriptFailedError("ScriptExit", message, last)
