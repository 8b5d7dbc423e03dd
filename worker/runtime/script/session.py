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
import contextlib
import dataclasses
import functools
import logging
import os
import signal
import threading
from types import FrameType

import torch
import torch.distributed as torch_dist

from service.core.config import Settings
from worker.attempt import RESUMED_FROM_STEP
from worker.runtime.attempt_client import AttemptClient
from worker.runtime.checkpoints.saver import make_checkpointer
from worker.runtime.distributed import DistContext
from worker.runtime.main import hand_over_reported, load_spec
from worker.runtime.metrics.sink import make_sink
from worker.runtime.session import RankSession
from worker.runtime.signals import STOP_SIGNALS, StopFlag, stop_signal_handlers
from worker.runtime.topology import RankEnv

log = logging.getLogger(__name__)
# The spill file of the script's metrics writer (the rank process may have its own).
SCRIPT_WRITER = "script"


class CollectiveBeforeInitError(RuntimeError):
    """A ``ddpq`` collective was called before the script's process group is up."""


class ScriptSession(RankSession):
    """A ``RankSession`` inside a command job's script (see the module docstring)."""

    polls_stop = False  # whether the script ever called should_stop
    finished = False  # whether ``finish`` ran
    # The rank's stop-signal handling, entered for the script's whole life.
    signal_handlers: contextlib.ExitStack | None = None

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

    def finish(self) -> None:
        """At the script's exit: write what was reported and wait for the checkpoint in flight
        and its upload (bounded as at a rank's end). Never raises; a second call does
        nothing."""
        if self.finished:
            return
        for step in (self.flush, self.sink.close, self.checkpointer.close):
            try:
                step()
            except Exception:
                log.exception("ddpq: while finishing the script's session")
        self.finished = True


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
        transport=settings.checkpoint_transport, stopping=stop.is_set,
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
    """The rank's stop-signal handling (flag and grace thread), plus: a script that never
    asked ``should_stop`` leaves at the signal itself."""
    if not _on_main_thread():
        log.warning("ddpq: first called off the main thread: stop signals are not handled")
        return
    stack = contextlib.ExitStack()
    stack.enter_context(stop_signal_handlers(session.stop_flag))  # for the process's life
    flag = session.stop_flag

    def _handler(signum: int, _frame: FrameType | None) -> None:
        flag.request(f"received {signal.Signals(signum).name}", signum)
        if not session.polls_stop:
            raise SystemExit(128 + signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, _handler)
    session.signal_handlers = stack  # never closed: the grace thread lives as long as the script


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
