"""One rank's life: environment → log redirect → spec → process group → train → result/error.

The rank holds no database handle: its spec is the JSON file the worker wrote into the
attempt directory (``service.core.artifacts.spec_path``), and everything it records goes
through the attempt API (``worker.runtime.attempt_client``) with the attempt's token.

``python -m worker.runtime`` (under torchrun) and the Slurm launcher's submitit function both
call ``run_rank``; its return value is the rank's exit code (``worker.attempt.ExitCode``).
Under torchrun a rank also dies with torchrun (``die_with_parent``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import random
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from pydantic import ValidationError

from ddpq import _state as ddpq_session
from service.core.artifacts import rank_log_path, rank_log_pipe_path, spec_path
from service.core.config import Settings
from service.core.errors import DdpqError, StaleAttemptError
from service.core.metrics.points import json_safe
from service.core.spec.command import command_problems
from service.core.spec.model import JobSpec
from service.core.wire.attempt import AttemptSelf
from worker import attempt as contract
from worker.attempt import (
    ExitCode,
    FailureReason,
    mark_before_first_step,
    mark_finished,
    now_s,
    reason_of,
    signal_exit,
    write_rank_error,
    write_result,
)
from worker.processes import has_tags, set_parent_death_signal
from worker.runtime.attempt_client import ApiUnavailableError, AttemptClient, AttemptRequestError
from worker.runtime.checkpoints.saver import CheckpointSaver, make_checkpointer
from worker.runtime.distributed import DistContext, init_distributed, shutdown_distributed
from worker.runtime.metrics.buffer import Sink
from worker.runtime.metrics.sink import make_sink
from worker.runtime.rank_output import rank_logging, redirect_output
from worker.runtime.script.run import ScriptFailedError, run_command
from worker.runtime.signals import StopFlag, StopRequested, stop_signal_handlers
from worker.runtime.topology import RankEnv, RankEnvironmentError
from worker.runtime.train.context import Entrypoint, TrainContext, load_entrypoint
from worker.runtime.watchdog import StallWatchdog, dump_on_expiry, exit_on_stall
from worker.tasks import ENTRYPOINTS

log = logging.getLogger(__name__)
# Failures a rank decides on its own (a non-finite loss, a stall): still failures when a stop
# signal (e.g. torchrun's teardown after a peer failed alike) arrives while they are raised.
OWN_DECISIONS = frozenset({FailureReason.NONFINITE_LOSS, FailureReason.STALLED})
# Seconds a rank ended mid-code gives its metrics writer: inside what is left of the launcher's
# SIGTERM → SIGKILL grace (10 s) after the stop grace (DDPQ_STOP_GRACE_S, 5 s).
FORCED_EXIT_DRAIN_S = 3.0

# Set by torchrun in every rank it starts (torch.distributed.elastic's worker environment).
TORCHRUN_MARKER = "TORCHELASTIC_RUN_ID"


class SpecFileError(DdpqError):
    """The attempt's spec file is missing or does not hold a valid job spec (a setup failure:
    relaunching the same attempt would find the same file)."""

    status_code = 500
    code = "spec_file"
    reason = FailureReason.SETUP


def die_with_parent(environ: Mapping[str, str], sig: signal.Signals = signal.SIGTERM) -> bool:
    """Under torchrun on Linux, have the kernel send ``sig`` to this rank when torchrun exits.

    torchrun starts every rank in a session of its own and only torchrun itself gets
    ``PR_SET_PDEATHSIG`` (from the local launcher), so a SIGKILLed torchrun would leave its
    ranks running. ``sig`` (SIGTERM) lets a training rank stop at a step boundary with a
    checkpoint. Then the race: if torchrun died before the ``prctl`` (this process was
    reparented, or its parent is no longer a process of this job's attempt, judged by the
    ``DDPQ_JOB_ID``/``DDPQ_ATTEMPT`` entries of its environment), the rank sends ``sig`` to
    itself at once.

    A no-op elsewhere: off Linux, and outside torchrun (Slurm's task process, in-process
    callers such as tests), where the parent's death says nothing about the rank.

    Returns:
        True when the parent-death signal is armed.
    """
    if not sys.platform.startswith("linux") or TORCHRUN_MARKER not in environ:
        return False
    parent = os.getppid()
    if not set_parent_death_signal(sig):
        return False
    if os.getppid() != parent or not _runs_same_attempt(parent, environ):
        sys.stderr.write(f"ddpq rank: parent {parent} (torchrun) is gone; stopping\n")
        os.kill(os.getpid(), sig)
    return True


def _runs_same_attempt(pid: int, environ: Mapping[str, str]) -> bool:
    """Whether process ``pid`` carries this rank's job id and attempt in its environment
    (torchrun does; init or a subreaper that adopted an orphaned rank does not)."""
    tags = frozenset(
        f"{name}={environ[name]}".encode()
        for name in (contract.JOB_ID, contract.ATTEMPT)
        if name in environ
    )
    return has_tags(pid, tags)


def run_rank(environ: Mapping[str, str] | None = None) -> int:
    """Run this process as one rank of a job and return its exit code.

    Args:
        environ: the launcher's variables (``DDPQ_JOB_ID``, ``DDPQ_ATTEMPT``,
            ``DDPQ_API_URL``, ``DDPQ_ATTEMPT_TOKEN``, ``DDPQ_ARTIFACT_DIR``, ``RANK``,
            ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
            ``MASTER_PORT``). Default: ``os.environ``. A given mapping is copied into
            ``os.environ`` first, because torch's env:// rendezvous and ``Settings`` read
            from there.
    Returns:
        0 on success (rank 0 has written result.json); 1 on failure (this rank wrote
        error-rank-<rank>.json); 128 + signum when stopped by a signal; 75 when the attempt
        was fenced off (requeued or finished elsewhere).
    """
    if environ is None:
        environ = os.environ
    elif environ is not os.environ:
        os.environ.update(environ)
    die_with_parent(environ)
    try:
        env = RankEnv.from_environ(environ)
    except RankEnvironmentError as exc:
        sys.stderr.write(f"ddpq rank: {exc}\n")
        return ExitCode.FAILED
    settings = Settings()
    artifact_dir = settings.resolved_artifact_dir
    stop = StopFlag()
    log_path = rank_log_path(artifact_dir, env.job_id, env.attempt, env.rank)
    pipe_path = rank_log_pipe_path(artifact_dir, env.job_id, env.attempt, env.rank)
    with (
        redirect_output(log_path, pipe_path),
        rank_logging(env.job_id, env.attempt, env.rank),
        stop_signal_handlers(stop),
    ):
        return _run(env, settings, artifact_dir, stop)


def _stop_code(stop: StopFlag) -> int:
    return signal_exit(stop.signum) if stop.signum is not None else ExitCode.FENCED


def _run(env: RankEnv, settings: Settings, artifact_dir: Path, stop: StopFlag) -> int:
    log.info(
        "rank %d/%d starting (local_rank %d, pid %d)",
        env.rank,
        env.world_size,
        env.local_rank,
        os.getpid(),
    )
    api = AttemptClient(env.api_url, env.attempt_token)
    try:
        spec = load_spec(artifact_dir, env)
        me = check_attempt(api, env)
        if spec.is_command:  # the user's script initialises its own process group
            return run_command(spec, env, api, artifact_dir, stop)
        ctx = init_distributed(spec, env)
        code = _train(spec, ctx, env, settings, api, artifact_dir, stop, me)
        if code == ExitCode.OK:
            shutdown_distributed(ctx)
        return code
    except StaleAttemptError as exc:
        log.warning("stopping: %s", exc)
        return ExitCode.FENCED
    except StopRequested:
        log.warning("stopped: %s", stop.reason)
        return _stop_code(stop)
    except Exception as exc:
        at_s = now_s()
        if stop.is_set() and reason_of(exc) not in OWN_DECISIONS:
            # A peer stopping on the same signal breaks our collectives: not a failure.
            log.warning("stopped (%s) with %s: %s", stop.reason, type(exc).__name__, exc)
            return _stop_code(stop)
        if isinstance(exc, ScriptFailedError):  # the script's own traceback, in its log
            log.error("rank %d failed: the script ended with %s", env.rank, exc.exc_type)
            write_rank_error(
                artifact_dir, env.job_id, env.attempt, env.rank, exc, at_s,
                traceback_text=exc.traceback_text, exc_type=exc.exc_type,
            )  # fmt: skip
            return ExitCode.FAILED
        log.exception("rank %d failed", env.rank)
        write_rank_error(artifact_dir, env.job_id, env.attempt, env.rank, exc, at_s)
        return ExitCode.FAILED
    finally:
        api.close()


def load_spec(artifact_dir: Path, env: RankEnv) -> JobSpec:
    """The job's spec, from the file the worker wrote for this attempt before launching it
    (``spec_path``): a rank starts even while the API is down.

    Raises:
        SpecFileError: the file is missing, unreadable, not JSON or not a valid spec (the
            message names the file).
    """
    path = spec_path(artifact_dir, env.job_id, env.attempt)
    try:
        spec = JobSpec.model_validate(json.loads(path.read_bytes()))
    except FileNotFoundError:
        raise SpecFileError(
            f"no spec file at {path}: the worker writes it before it starts the ranks "
            f"(is {contract.ARTIFACT_DIR} the worker's artifact directory?)"
        ) from None
    except OSError as exc:
        raise SpecFileError(f"cannot read the spec file {path}: {exc}") from None
    except ValueError as exc:  # JSONDecodeError and pydantic's ValidationError alike
        count = exc.error_count() if isinstance(exc, ValidationError) else 1
        raise SpecFileError(
            f"the spec file {path} does not hold a valid job spec ({count} error(s)): {exc}"
        ) from None
    # What validate_spec adds across fields (the deployment's own rules were the API's call).
    dumped = spec.model_dump(include={"task", "command", "workspace", "checkpoints", "metrics"})
    problems = command_problems(dumped, user_code_allowed=True)
    if problems:
        said = "; ".join(f"{field}: {msg}" for field, msg in problems)
        raise SpecFileError(f"the spec file {path} does not hold a valid job spec: {said}")
    return spec


def check_attempt(api: AttemptClient, env: RankEnv) -> AttemptSelf | None:
    """Ask the attempt API once whether this attempt is still the job's current one, so a rank
    of a superseded attempt stops before it joins the process group.

    An unreachable API is no reason not to start (the sink retries; the fence still holds on
    every write): logged, and the rank goes on.

    Returns:
        The answer (its ``store_id`` decides the checkpoint transport, its ``init_from`` where
        a job without checkpoints starts); None when the API could not be asked.

    Raises:
        StaleAttemptError: the API refused the token (409 superseded, 401 invalid).
        RankEnvironmentError: the token stands for another job or attempt.
    """
    try:
        me = api.self_check()
    except (ApiUnavailableError, AttemptRequestError) as exc:
        log.warning("attempt API not reachable at start, going on: %s", exc)
        return None
    if (me.job_id, me.attempt) != (env.job_id, env.attempt):
        raise RankEnvironmentError(
            f"{contract.ATTEMPT_TOKEN} is the token of job {me.job_id} attempt {me.attempt}, "
            f"not of job {env.job_id} attempt {env.attempt}"
        )
    return me


def seed_everything(seed: int) -> None:
    """Seed torch, numpy and python's RNGs alike on every rank (identical model init)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def resolve_entrypoint(task: str, settings: Settings) -> Entrypoint:
    """The function a rank runs for ``task``: a built-in task's entrypoint
    (``worker.tasks.ENTRYPOINTS``), else the user's ``"package.module:function"``.

    Raises:
        EntrypointError: see ``load_entrypoint``.
    """
    builtin = ENTRYPOINTS.get(task)
    return builtin if builtin is not None else load_entrypoint(task, settings)


def _train(
    spec: JobSpec,
    dist: DistContext,
    env: RankEnv,
    settings: Settings,
    api: AttemptClient,
    artifact_dir: Path,
    stop: StopFlag,
    me: AttemptSelf | None = None,
) -> int:
    """The one training path: resolve the entrypoint, build its TrainContext, call it, close,
    then rank 0 records the result."""
    seed_everything(spec.training.seed)
    sink = make_sink(env, dist, artifact_dir=artifact_dir)
    stop.at_forced_exit(functools.partial(hand_over_reported, sink))
    checkpointer = make_checkpointer(
        env, artifact_dir, keep=spec.training.keep_checkpoints,
        transport=settings.checkpoint_transport, attempt_self=me, stopping=stop.is_set,
        points=sink,
    )  # fmt: skip
    on_stall = functools.partial(
        exit_on_stall,
        artifact_dir=artifact_dir,
        job_id=env.job_id,
        attempt=env.attempt,
        rank=env.rank,
    )
    # Started by the first step (built-in tasks) or the first ctx call (entrypoints); stopped
    # before the final close, which waits on the attempt API and the checkpoint writer.
    watchdog = StallWatchdog(spec.training.stall_timeout_s, on_stall, on_expired=dump_on_expiry)
    try:
        assert spec.task is not None, "a job without a command has a task (validate_spec)"
        entrypoint = resolve_entrypoint(spec.task, settings)
        ctx = TrainContext(
            spec=spec,
            dist=dist,
            sink=sink,
            checkpointer=checkpointer,
            stop=stop,
            api=api,
            artifact_dir=artifact_dir,
            job_id=env.job_id,
            attempt=env.attempt,
            watchdog=watchdog,
            attempt_self=me,
        )
        ddpq_session.use(ctx)  # the ddpq library's calls in the entrypoint reach this context
        returned = entrypoint(ctx)
        mark_finished(artifact_dir, env.job_id, env.attempt, env.rank)
        ctx.close()
    except BaseException as exc:
        ddpq_session.use(None)
        watchdog.stop()
        if not watchdog.stepped:
            mark_before_first_step(exc)  # the same spec would fail the same way: no retry
        _close_quietly(sink, checkpointer)
        raise
    ddpq_session.use(None)
    watchdog.stop()
    sink.close()
    checkpointer.close()
    step = ctx.last_step
    if ctx.stopped or ctx.local_stop():
        log.warning("stopped at step %d without finishing: %s", step, stop.reason or "fenced off")
        return _stop_code(stop)
    final = sink.final_metrics()
    if final is not None:  # rank 0 (the sink's constructor decides who records)
        extra = returned.items() if isinstance(returned, Mapping) else ()
        for key, value in extra:
            if isinstance(value, int | float):
                final[str(key)] = json_safe(float(value))
            elif _json_scalar(value):
                final[str(key)] = value
        saved = checkpointer.last_saved
        path = write_result(
            artifact_dir,
            env.job_id,
            env.attempt,
            step=step,
            final_metrics=final,
            checkpoint=str(saved.path) if saved else None,
        )
        log.info("result written to %s", path)
    log.info("rank %d finished at step %d", env.rank, step)
    return ExitCode.OK


def hand_over_reported(sink: Sink, timeout_s: float = FORCED_EXIT_DRAIN_S) -> None:
    """A rank about to be ended mid-code (no step boundary saw the stop signal): what it
    reported is written before it goes. The buffer goes to the writer as this rank's own
    values (a collective is not safe from another thread), then the writer gets up to
    ``timeout_s`` seconds; what is still unsent then is logged (and stays in the spill
    file when it got there)."""
    sink.flush(average=False)
    if not sink.drain(timeout_s):
        log.error("metrics not all written within %.1f s of the forced exit", timeout_s)


def _json_scalar(value: object) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def _close_quietly(sink: Sink, checkpointer: CheckpointSaver) -> None:
    """On the way out of a failure: write what can be written, never mask the real error.
    The points still buffered (up to a flush's worth of steps before the failure, the ones
    most needed to debug it) go out as rank 0's own values: a collective is no longer safe."""
    for close in (functools.partial(sink.flush, average=False), sink.close, checkpointer.close):
        try:
            close()
        except Exception:
            log.exception("while closing after a failure")
    with contextlib.suppress(Exception):
        sys.stdout.flush()
