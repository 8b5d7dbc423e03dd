"""The local launcher: each attempt is one torchrun process group on the worker's host.

torchrun (``--standalone``: its own rendezvous on a free port, so jobs never share a port)
runs ``nproc_per_node`` rank processes of ``worker.runtime``, started by
``python -m worker.runtime.agent`` (torchrun's agent with the ranks forked warm from a fork
server; see that module). Cancelling, a timeout or a known failure signals every process
group of the attempt, found by the tags in the ranks' environment
(``worker.launchers.local.process_groups``; stopping a run and reading its outcome:
``worker.launchers.local.run``). torchrun gets ``PR_SET_PDEATHSIG=SIGTERM``: if the
worker dies, torchrun stops its ranks (and each rank sets its own,
``worker.runtime.main.die_with_parent``, in case torchrun dies).

Every attempt starts in an empty directory: one left over from an earlier life of the same
job id and attempt (e.g. the database was recreated but the artifact dir kept) is moved aside
to ``attempt-<n>.stale-<UTC time>``, and a ``result.json`` counts only if it was written after
the attempt started (by the file system's clock). The plan's files (the spec as
``spec.json``, mode 0600) are written there before torchrun starts.

The ranks hold no secret of the worker's: their environment is ``inherited_env`` of the
worker's (an allow-list) plus the plan's entries (the API URL and the attempt token; no
database URL). With ``DDPQ_RANK_USERS`` (or ``DDPQ_RANK_USER``) a root-run worker starts each
job's torchrun as its owner's Unix user, resolved at launch from the plan's ``owner``
(``worker.launchers.local.rank_user``); the attempt directory (0700), its workspace and logs,
and the job's checkpoint directory are that user's alone (``attempt_dir``).

What an attempt may consume: its output reaches the log files through the worker, capped
(``worker.launchers.local.attempt_logs``); torchrun and its ranks get ``RLIMIT_NPROC`` and
``RLIMIT_NOFILE`` (``worker.launchers.local.process_limits``) and, on a cgroup v2 host, a cgroup
of their own for memory and pids (``worker.launchers.local.cgroups``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Self

from service.core import artifacts
from service.core.config import Settings
from service.core.owners.rank_users import RANK_USER_SETTING, RANK_USERS_SETTING
from service.core.spec.model import JobSpec
from worker.attempt import (
    ALLOWED_ENTRYPOINTS,
    API_URL,
    ARTIFACT_DIR,
    RANK_CODE,
    FailureReason,
    attempt_tags,
    rank_env,
)
from worker.errors import LaunchError
from worker.launchers.base import LaunchPlan, RunPhase, RunStatus
from worker.launchers.local.attempt_dir import open_launcher_log, prepare_attempt_dir
from worker.launchers.local.attempt_logs import AttemptLogs
from worker.launchers.local.cgroups import JobCgroup, job_cgroup_support
from worker.launchers.local.process_limits import RankLimits, launch_preexec
from worker.launchers.local.rank_user import (
    RankUser,
    RankUsers,
    popen_identity,
    process_env,
)
from worker.launchers.local.run import (
    LocalRun,
    failure_known,
    finish,
    has_result,
    kill_leftovers,
    terminate,
)
from worker.launchers.preflight import entrypoint_setup_failure

log = logging.getLogger(__name__)

NAME = "local"
RANK_ENTRY: tuple[str, ...] = ("-m", "worker.runtime")
# torchrun with warm ranks (forked with torch and ddpq imported); any other entry runs as
# under plain torchrun. See worker/runtime/agent.py.
AGENT_MODULE = "worker.runtime.agent"
TORCHRUN_MODULE = "torch.distributed.run"  # with DDPQ_WARM_RANKS=false
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
DEFAULT_GRACE_S = 10.0  # SIGTERM → SIGKILL, seconds
DEFAULT_TEARDOWN_GRACE_S = 30.0  # result.json written, processes still alive: then kill
# A rank wrote its error file, processes still alive after this long: the failure is known,
# so the rest of the attempt is killed instead of waiting out torchrun's own teardown (which
# gives a rank busy outside a step boundary 30 s). Seconds.
DEFAULT_FAILURE_GRACE_S = 2.0
MAX_FINISHED_RUNS = 1000


@dataclass(frozen=True)
class LocalRequest:
    """The local launcher's part of a plan: what ``start`` and ``poll`` need besides the
    command line. ``timeout_s``: seconds the attempt may run (``resources.timeout_min``),
    None for no limit. ``entrypoint``: the user's ``"module:function"`` that ``start`` checks
    before it starts ranks (None for a built-in task, or one not on the allow-list: the ranks
    say why)."""

    timeout_s: float | None = None
    entrypoint: str | None = None


class LocalLauncher:
    """Runs attempts as torchrun subprocesses on this host (see the module docstring)."""

    name = NAME

    def __init__(
        self,
        settings: Settings,
        *,
        cwd: Path | None = None,
        grace_s: float = DEFAULT_GRACE_S,
        teardown_grace_s: float = DEFAULT_TEARDOWN_GRACE_S,
        failure_grace_s: float = DEFAULT_FAILURE_GRACE_S,
        entry: Sequence[str] = RANK_ENTRY,
        python: str = sys.executable,
    ) -> None:
        """Args:
        settings: where ranks find the API (``resolved_api_url``) and the artifact root;
            ``warm_ranks`` picks worker.runtime.agent (default) or plain torchrun;
            ``rank_user_map`` the Unix user each owner's ranks run as (the worker must be
            root).
        cwd: the ranks' working directory (default: the worker's; user entrypoints such as
            ``examples.*`` are imported relative to it).
        grace_s: seconds between SIGTERM and SIGKILL on cancel.
        teardown_grace_s: seconds an attempt may linger after rank 0 wrote result.json.
        failure_grace_s: seconds an attempt may linger after a rank wrote its error file
            (torchrun's summary is written by then); then what is left is SIGKILLed.
        entry: what torchrun runs per rank (default ``-m worker.runtime``).
        python: the interpreter that runs torchrun.
        Raises:
            LaunchError: a rank user map is set but this process is not root, or a user it
                names does not exist.
        """
        self.api_url = settings.resolved_api_url
        self.allowed_entrypoints = list(settings.allowed_entrypoints)
        self.rank_users = RankUsers(
            settings.rank_user_map,
            setting=RANK_USERS_SETTING if settings.rank_users else RANK_USER_SETTING,
        )
        self.artifact_dir = settings.resolved_artifact_dir
        self.cwd = (cwd or Path.cwd()).resolve()
        self.grace_s = grace_s
        self.teardown_grace_s = teardown_grace_s
        self.failure_grace_s = failure_grace_s
        self.entry = tuple(entry)
        self.python = python
        self.agent = AGENT_MODULE if settings.warm_ranks else TORCHRUN_MODULE
        self.entrypoint_allowed = settings.entrypoint_allowed
        self.log_cap_bytes = settings.rank_log_max_bytes
        self.limits = RankLimits.from_settings(settings)
        self.pids_max = settings.job_pids_max
        self.memory_max_bytes = settings.job_memory_max_bytes
        self.cgroups = job_cgroup_support(self.pids_max, self.memory_max_bytes)
        self._runs: dict[str, LocalRun] = {}
        self._refused: dict[str, RunStatus] = {}  # attempts whose entrypoint did not resolve

    @classmethod
    def from_settings(cls, settings: Settings) -> Self:
        """The launcher of a worker of this deployment (all defaults; ``settings`` decide)."""
        return cls(settings)

    def bind_gpus(
        self, plan: LaunchPlan[LocalRequest], gpus: Sequence[int]
    ) -> LaunchPlan[LocalRequest]:
        """The plan with ``CUDA_VISIBLE_DEVICES`` set to the GPU ids the worker assigned."""
        return replace(plan, env={**plan.env, CUDA_VISIBLE_DEVICES: ",".join(map(str, gpus))})

    def plan(self, spec: JobSpec, job_id: int, attempt: int) -> LaunchPlan[LocalRequest]:
        """The torchrun command line, environment and spec file for one attempt; touches
        nothing. The environment names the API the ranks report to, never the database; the
        loop adds the attempt token (``base.with_attempt_token``).

        GPU jobs see GPUs ``0..gpus_per_node-1`` unless the worker rebinds them with
        ``bind_gpus``; CPU jobs get ``CUDA_VISIBLE_DEVICES=""``.
        """
        r = spec.resources
        argv = [
            self.python, "-m", self.agent,
            "--standalone",
            "--nnodes", "1",
            "--nproc_per_node", str(r.nproc_per_node),
            "--max_restarts", "0",
            *self.entry,
        ]  # fmt: skip
        env = {
            **rank_env(job_id, attempt, artifact_dir=self.artifact_dir,
                       cpus_per_task=r.cpus_per_task, user_env=spec.env),
            API_URL: self.api_url,
            CUDA_VISIBLE_DEVICES: ",".join(str(i) for i in range(r.gpus_per_node)),
        }  # fmt: skip
        if spec.is_command and self.agent == AGENT_MODULE:
            env[RANK_CODE] = "script"  # its fork server skips the trainer's imports
        if self.allowed_entrypoints:
            # The ranks check the task against the worker's list, whatever their environment.
            env[ALLOWED_ENTRYPOINTS] = json.dumps(self.allowed_entrypoints)
        spec_file = artifacts.spec_path(self.artifact_dir, job_id, attempt).name
        return LaunchPlan(
            launcher=NAME,
            job_id=job_id,
            attempt=attempt,
            argv=argv,
            env=env,
            cwd=str(self.cwd),
            log_dir=str(artifacts.attempt_dir(self.artifact_dir, job_id, attempt)),
            request=LocalRequest(
                timeout_s=float(r.timeout_min * 60),
                entrypoint=spec.task if spec.task and self._checkable(spec.task) else None,
            ),
            files={spec_file: spec.model_dump_json()},
        )

    def _checkable(self, task: str) -> bool:
        """A user's entrypoint (built-in task names have no ``:``) that this deployment allows
        (``start`` imports no package of one it does not)."""
        return ":" in task and self.entrypoint_allowed(task)

    def _refuse_unresolvable(
        self, plan: LaunchPlan[LocalRequest], log_file: IO[bytes], user: RankUser | None
    ) -> str | None:
        """The handle of a refused attempt when the plan's entrypoint does not resolve
        (``preflight``), else None."""
        entrypoint = plan.request.entrypoint if plan.request is not None else None
        status = None if entrypoint is None else entrypoint_setup_failure(
            entrypoint, python=self.python, cwd=plan.cwd,
            env=process_env(plan.env, user), identity=popen_identity(user),
            artifact_dir=self.artifact_dir, job_id=plan.job_id, attempt=plan.attempt,
            attempt_dir=Path(plan.log_dir))  # fmt: skip
        if status is None:
            return None
        log_file.write(f"ddpq: no rank started: {status.reason}\n".encode())
        log_file.close()
        handle = f"refused-{plan.job_id}-{plan.attempt}"
        self._refused[handle] = status
        return handle

    def start(self, plan: LaunchPlan[LocalRequest]) -> str:
        """Start torchrun in a new session, its output appended to ``launcher.log``, after
        writing the plan's files (the spec) into the fresh attempt directory. torchrun gets
        ``inherited_env`` of the worker's environment plus the plan's; with a rank user map
        it runs as the plan's owner's user, who alone owns the attempt and checkpoint
        directories.

        A user entrypoint that does not resolve (``LocalRequest.entrypoint``) starts nothing:
        the attempt fails at once with the ``setup`` error its ranks would have written.

        Returns:
            The handle: torchrun's pid (also its process group id), as a string.
        Raises:
            LaunchError: the process could not be started, or the map has no user for the
                plan's owner (or it is gone).
        """
        user = self.rank_users.for_owner(plan.owner)
        log_path = artifacts.launcher_log_path(self.artifact_dir, plan.job_id, plan.attempt)
        try:
            stale = prepare_attempt_dir(plan, self.artifact_dir, user)
            log_file = open_launcher_log(log_path, user)
            started_fs_ns = os.fstat(log_file.fileno()).st_mtime_ns
        except (OSError, ValueError) as exc:
            raise LaunchError(f"could not prepare {log_path.parent}: {exc}") from exc
        if stale is not None:
            log.warning("job_id=%d attempt=%d: moved a stale attempt directory aside to %s",
                        plan.job_id, plan.attempt, stale)  # fmt: skip
        if user is not None:
            log.info("job_id=%d attempt=%d: ranks run as %s (owner %s)",
                     plan.job_id, plan.attempt, user.name, plan.owner)  # fmt: skip
        refused = self._refuse_unresolvable(plan, log_file, user)
        if refused is not None:
            return refused
        log_file.close()  # from here on the worker writes it, capped
        logs, cgroup = self._attempt_parts(plan, user)
        try:
            output_fd = logs.open()
        except OSError as exc:
            self._discard(logs, cgroup)
            raise LaunchError(f"could not make the log pipes in {plan.log_dir}: {exc}") from exc
        try:
            popen = subprocess.Popen(
                plan.argv,
                cwd=plan.cwd,
                env=process_env(plan.env, user),
                stdin=subprocess.DEVNULL,
                stdout=output_fd,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=launch_preexec(
                    self.limits, cgroup.procs_fd if cgroup else None, signal.SIGTERM
                ),
                **popen_identity(user),
            )
        except (OSError, subprocess.SubprocessError) as exc:
            self._discard(logs, cgroup)
            raise LaunchError(f"could not start {plan.argv[0]}: {exc}") from exc
        finally:
            os.close(output_fd)
        if cgroup is not None:
            cgroup.release_procs_fd()
        request = plan.request if plan.request is not None else LocalRequest()
        handle = str(popen.pid)
        self._runs[handle] = LocalRun(
            plan=plan,
            popen=popen,
            logs=logs,
            cgroup=cgroup,
            tags=attempt_tags(plan.job_id, plan.attempt, plan.env[ARTIFACT_DIR]),
            started_mono=time.monotonic(),
            timeout_s=request.timeout_s,
            started_fs_ns=started_fs_ns,
        )
        self._prune()
        return handle

    def _attempt_parts(
        self, plan: LaunchPlan[LocalRequest], user: RankUser | None
    ) -> tuple[AttemptLogs, JobCgroup | None]:
        """The attempt's capped logs (not yet open; their FIFOs ``user``'s) and its cgroup
        (where the host has them).

        Raises:
            LaunchError: the cgroup could not be made.
        """
        # The ranks on this host: what torchrun is told (one node), else one.
        flag = "--nproc_per_node"
        nproc = int(plan.argv[plan.argv.index(flag) + 1]) if flag in plan.argv else 1
        logs = AttemptLogs(
            self.artifact_dir, plan.job_id, plan.attempt, nproc, self.log_cap_bytes,
            owner=user.owner if user is not None else None,
        )  # fmt: skip
        if self.cgroups.parent is None:
            return logs, None
        try:
            cgroup = JobCgroup.create(
                self.cgroups.parent, plan.job_id, plan.attempt,
                pids_max=self.pids_max, memory_max_bytes=self.memory_max_bytes,
            )  # fmt: skip
        except OSError as exc:
            raise LaunchError(f"could not make the attempt's cgroup: {exc}") from exc
        return logs, cgroup

    @staticmethod
    def _discard(logs: AttemptLogs, cgroup: JobCgroup | None) -> None:
        logs.close()
        if cgroup is not None:
            cgroup.remove()

    def poll(self, handle: str) -> RunStatus:
        """Observe the attempt: running, or how it ended (stable once ended).

        Success is decided by rank 0's ``result.json``, not by the exit code. A failure's
        reason names the earliest failing rank and its exception, else torchrun's exit code
        and the tail of ``launcher.log``. Enforces ``resources.timeout_min``.
        """
        run = self._runs.get(handle)
        if run is None and handle in self._refused:
            return self._refused[handle]
        if run is None:
            return RunStatus(
                RunPhase.FAILED,
                f"no local run {handle} (the worker restarted?)",
                failure=FailureReason.ERROR,
            )
        if run.final is not None:
            return run.final
        if run.popen.poll() is None:
            now = time.monotonic()
            if has_result(run, self.artifact_dir):
                run.result_seen_mono = run.result_seen_mono or now
                if now - run.result_seen_mono < self.teardown_grace_s:
                    return RunStatus(RunPhase.RUNNING)
                log.warning("job_id=%d teardown hangs after result.json; killing", run.plan.job_id)
                terminate(run, self.artifact_dir, grace_s=1.0)
            elif failure_known(run, now, self.failure_grace_s):
                log.warning("job_id=%d attempt=%d: a rank failed and the attempt still runs "
                            "after %.0f s; killing it", run.plan.job_id, run.plan.attempt,
                            self.failure_grace_s)  # fmt: skip
                kill_leftovers(run)
            elif run.timeout_s is not None and now - run.started_mono > run.timeout_s:
                run.timed_out = True
                terminate(run, self.artifact_dir, grace_s=self.grace_s)
            else:
                return RunStatus(RunPhase.RUNNING)
        return finish(run, self.artifact_dir)

    def cancel(self, handle: str) -> None:
        """SIGTERM the attempt's process groups, SIGKILL after ``grace_s``; reap torchrun.

        Idempotent; returns once no process of the attempt is left.
        """
        self._cancel(handle, upload_wait=True)

    def stop_within_grace(self, handle: str) -> None:
        """``cancel`` without waiting for a stop checkpoint's upload: SIGKILL after
        ``grace_s`` seconds at the latest (the lease fence: the API may be unreachable)."""
        self._cancel(handle, upload_wait=False)

    def _cancel(self, handle: str, *, upload_wait: bool) -> None:
        run = self._runs.get(handle)
        if run is None:
            return
        if run.final is None and run.popen.poll() is None:
            run.cancelled = True
        terminate(run, self.artifact_dir, grace_s=self.grace_s, upload_wait=upload_wait)

    def _prune(self) -> None:
        finished = [h for h, r in self._runs.items() if r.final is not None]
        for handle in finished[: max(0, len(finished) - MAX_FINISHED_RUNS)]:
            del self._runs[handle]
