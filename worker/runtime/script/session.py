"""The ``ddpq`` library's session inside a command job's script: built from the environment.

A command job's script is a process of its own (``worker.runtime.script.run``), with the
rank's environment: ``DDPQ_JOB_ID``, ``DDPQ_ATTEMPT``, ``DDPQ_API_URL``,
``DDPQ_ATTEMPT_TOKEN``, ``DDPQ_ARTIFACT_DIR`` and torchrun's RANK/LOCAL_RANK/WORLD_SIZE. At the
script's first ``ddpq`` call, ``script_session`` builds the same ``RankSession`` an entrypoint
rank runs on, with its own sink (spilling to ``metrics-spill-script.jsonl``) and checkpointer.

The script owns its process group: the session's collectives (``should_stop``,
``load_checkpoint``, ``report(mean=True)``) need it initialised, and run on a gloo group of
their own (made at the first one) when the script's backend is not gloo.

Stop signals: once the session exists, SIGTERM/SIGINT/SIGUSR1 raise its stop flag. A script
that has called ``should_stop`` sees True at its next call (within ``DDPQ_STOP_GRACE_S``, else
it is ended as an entrypoint rank would be); one that never did is ended at once by the
signal (``SystemExit(128 + signum)``), after its reported points are written.

``DDPQ_RESUMED_FROM_STEP`` (set by the rank when it restored a followed checkpoint file before
starting the script) is what ``ddpq.info().resumed_from_step`` says until the script loads a
checkpoint itself. It is not told to the API as the resume step: the script's own steps say
where it goes on (its first report, ``AttemptFacts.begin_at_report``).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as torch_dist

from service.core.config import Settings
from worker.attempt import RESUMED_FROM_STEP
from worker.runtime.attempt_client import AttemptClient
from worker.runtime.checkpoints.files import CheckpointWriteError
from worker.runtime.checkpoints.saver import make_checkpointer
from worker.runtime.distributed import DistContext
from worker.runtime.main import hand_over_reported, load_spec
from worker.runtime.metrics.sink import make_sink
from worker.runtime.signals import STOP_SIGNALS, StopFlag, install_stop_handlers
from worker.runtime.topology import RankEnv
from worker.runtime.train.session import RankSession

log = logging.getLogger(__name__)
# The spill file of the script's metrics writer (the rank process may have its own).
SCRIPT_WRITER = "script"


class CollectiveBeforeInitError(RuntimeError):
    """A ``ddpq`` collective was called before the script's process group is up."""


class FollowedCheckpointsError(RuntimeError):
    """``ddpq.save_checkpoint`` in a job that follows the script's own checkpoint file."""


class ScriptSession(RankSession):
    """A ``RankSession`` inside a command job's script (see the module docstring)."""

    polls_stop = False  # whether the script ever called should_stop
    finishing = False  # whether ``finish`` began (a stop signal then changes nothing)
    finished = False  # whether ``finish`` ran

    def collective_dist(self) -> DistContext:
        """The script's process group, with a gloo group for ddpq's small CPU votes when the
        script's backend is another (made once, by every rank at the same call).

        Raises:
            CollectiveBeforeInitError: more than one rank and no process group yet.
        """
        current = self.dist
        if current.world_size == 1 or current.control_group is not None:
            return current
        if not (torch_dist.is_available() and torch_dist.is_initialized()):
            raise CollectiveBeforeInitError(
                "ddpq.should_stop(), ddpq.load_checkpoint() and ddpq.report(mean=True) talk "
                "to the other ranks: call torch.distributed.init_process_group() first"
            )
        backend = str(torch_dist.get_backend())
        gloo = backend == "gloo"
        group = torch_dist.group.WORLD if gloo else torch_dist.new_group(backend="gloo")
        self.dist = dataclasses.replace(current, backend=backend, control_group=group)
        return self.dist

    @property
    def resumed_from_step(self) -> int | None:
        """The step of the checkpoint this attempt started from: one the script loaded, else
        the followed file the rank restored before starting it."""
        loaded = super().resumed_from_step
        restored = os.environ.get(RESUMED_FROM_STEP, "")
        return loaded if loaded is not None or not restored.isdigit() else int(restored)

    def should_stop(self) -> bool:
        """See ``RankSession.should_stop``; from the first call on, a stop signal waits for
        the script's next call instead of ending it."""
        self.polls_stop = True
        return super().should_stop()

    def save_checkpoint(self, state: Any, step: int, epoch: int = 0) -> None:
        """See ``RankSession.save_checkpoint``.

        Raises:
            FollowedCheckpointsError: the job follows the script's own checkpoint file
                (``checkpoints.path``): one series of checkpoints per job.
        """
        if self.spec.checkpoints is not None:
            raise FollowedCheckpointsError(
                f"this job follows your script's own checkpoint file "
                f"(checkpoints.path: {self.spec.checkpoints.path}); a job keeps one series of "
                "checkpoints: drop checkpoints.path to save with ddpq.save_checkpoint, or save "
                "only that file"
            )
        super().save_checkpoint(state, step, epoch)

    def finish(self) -> None:
        """At the script's exit: write what was reported and wait for the checkpoint in flight
        and its upload (bounded as at a rank's end). A second call does nothing.

        When the newest checkpoint asked for could not be written or uploaded, the script
        ends with exit code 1 and the error as its traceback's last line (the job fails, as a
        built-in task whose final checkpoint failed does), instead of succeeding without it.
        """
        if self.finished or self.finishing:
            return
        self.finishing = True
        failed: CheckpointWriteError | None = None
        for step in (self.flush, self.sink.close, self.checkpointer.close):
            try:
                step()
            except CheckpointWriteError as exc:
                failed = exc
            except Exception:
                log.exception("ddpq: while finishing the script's session")
        self.finished = True
        if failed is not None:
            sys.stderr.write(
                f"Traceback (most recent call last):\n  (ddpq, at the script's exit)\n"
                f"CheckpointWriteError: {failed}\n"
            )
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(1)


def _device(env: RankEnv, gpus_per_node: int) -> torch.device:
    """``cuda:<local_rank>`` when the job has GPUs and CUDA is here, else CPU (the script
    picks its own device; this is where ``load_checkpoint`` maps tensors by default)."""
    if gpus_per_node > 0 and torch.cuda.is_available():
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def script_session() -> ScriptSession:
    """The session of this script process, from its environment (see the module docstring).

    Raises:
        RankEnvironmentError: a ddpq variable is missing or malformed.
        SpecFileError: the attempt's spec file cannot be read.
    """
    env = RankEnv.from_environ(os.environ)
    settings = Settings()
    artifact_dir = settings.resolved_artifact_dir
    spec = load_spec(artifact_dir, env)
    dist = DistContext(
        env.rank, env.local_rank, env.world_size, _device(env, spec.resources.gpus_per_node),
        spec.strategy, spec.resolved_backend,
    )  # fmt: skip
    stop = StopFlag()
    sink = make_sink(env, dist, artifact_dir=artifact_dir, writer=SCRIPT_WRITER)
    checkpointer = make_checkpointer(
        env, artifact_dir, keep=spec.training.keep_checkpoints,
        transport=settings.checkpoint_transport, stopping=stop.is_set, points=sink,
    )  # fmt: skip
    session = ScriptSession(
        spec=spec, dist=dist, sink=sink, checkpointer=checkpointer, stop=stop,
        api=AttemptClient(env.api_url, env.attempt_token), artifact_dir=artifact_dir,
        job_id=env.job_id, attempt=env.attempt,
    )  # fmt: skip
    stop.at_forced_exit(functools.partial(hand_over_reported, sink))
    _handle_stop_signals(session)
    atexit.register(session.finish)
    return session


def _handle_stop_signals(session: ScriptSession) -> None:
    """Stop signals raise the session's stop flag. A script with handlers of its own keeps
    them: they are called after the flag is raised. Otherwise the rank's handling applies (the
    grace thread of ``worker.runtime.signals``), and a script that never asked
    ``should_stop`` leaves at the signal itself, its reported points written (``atexit``)."""
    if not _on_main_thread():
        log.warning("ddpq: first called off the main thread: stop signals are not handled")
        return
    theirs = {
        sig: handler
        for sig in STOP_SIGNALS
        if callable(handler := signal.getsignal(sig)) and handler is not signal.default_int_handler
    }
    if not theirs:  # for the process's life: nothing to restore at its exit
        install_stop_handlers(session.stop_flag)
    flag = session.stop_flag

    def _handler(signum: int, frame: FrameType | None) -> None:
        flag.request(f"received {signal.Signals(signum).name}", signum)
        own = theirs.get(signal.Signals(signum))
        if own is not None:
            own(signum, frame)
        elif not session.polls_stop and not session.finishing:
            raise SystemExit(128 + signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, _handler)


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
