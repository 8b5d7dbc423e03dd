"""Rank 0's side of a command job: the files its script already writes, turned into ddpq's.

- ``checkpoints.path``: each completed new version of the file (closed after writing, or
  renamed into place) is copied, hashed and uploaded as a checkpoint
  (``Checkpointer.save_file``), named by its workspace path; ``restore`` puts the newest one
  back before the script of the next attempt starts, on whichever host that is.
- ``metrics.tensorboard``: the scalars the script's ``SummaryWriter`` writes there become
  metric points (tag → name, global_step → step) through the rank's metrics writer, read as
  the event files grow (``worker.runtime.script.tensorboard``).

A version that completes once a stop was asked for (cancel, preemption, shutdown), or as the
script is ending, is held until the script has ended: a script killed by a signal or ending
on an error may have been cut off in the middle of writing it (the kernel closes its files
either way), so it is uploaded only when the script exited 0. A ``torch.save`` archive cut
short is never taken (``looks_torn``).

The follower runs on a thread of its own, beside the script: it wakes at once when a version
completes (inotify) and reads new scalars at least every ``POLL_S`` seconds, so it never slows
the script but by the copy of a new checkpoint version. Versions written faster than they can
be copied are taken as one (the newest), under the step of the newest: a version replaced
before its copy began is not taken under its own (``completed_version``). A followed
checkpoint's step is the newest scalar step seen when its version completed, or one more than
the previous version's, whichever is larger (the file says nothing of its step). The
attempt's resume step is what its first scalar says (``AttemptFacts.begin_at_report``): a
script that resumes from the restored file at epoch e+1 supersedes the earlier attempt's
points after e+1 only.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from pathlib import Path

import torch

from service.core import artifacts
from service.core.config import Settings
from service.core.metrics.points import MAX_STEP
from service.core.spec.model import JobSpec
from worker.runtime.attempt_client import AttemptClient
from worker.runtime.checkpoints.followed import (
    FollowedFiles,
    RestoredFile,
    relative_name,
    restore_followed,
)
from worker.runtime.checkpoints.saver import CheckpointSaver, make_checkpointer
from worker.runtime.distributed import DistContext
from worker.runtime.metrics.buffer import Progress, Sink
from worker.runtime.metrics.sink import make_sink
from worker.runtime.script.tensorboard import Scalar, TensorBoardScalars
from worker.runtime.signals import StopFlag
from worker.runtime.timeline import AttemptFacts
from worker.runtime.topology import RankEnv

log = logging.getLogger(__name__)
POLL_S = 1.0
# How soon a closed file another writer still holds open is looked at again (seconds).
RECHECK_S = 0.1
# How long a completed version waits to see whether the script is ending (seconds).
SETTLE_S = 0.2
# Where the rank that restored a followed file leaves its step for the host's other ranks.
RESTORED_STEP_NAME = ".restored-step"


def restore(
    spec: JobSpec, client: AttemptClient, artifact_dir: Path, job_id: int, attempt: int, root: Path
) -> RestoredFile | None:
    """Before the script starts (once per host, inside the workspace lock): the newest
    verified checkpoint of the followed file put back at its path in ``root``; None when the
    job follows none or has none yet. Its step is left in the attempt directory for
    ``restored_step``.

    Raises:
        CheckpointFetchError: the job has checkpoints but none could be brought here intact.
    """
    if spec.checkpoints is None:
        return None
    restored = restore_followed(client, artifact_dir, job_id, attempt, root, spec.checkpoints.path)
    if restored is not None:
        log.info("restored %s from the checkpoint of step %d", restored.file_name, restored.step)
        marker = artifacts.attempt_dir(artifact_dir, job_id, attempt) / RESTORED_STEP_NAME
        marker.write_text(str(restored.step))
    return restored


def restored_step(artifact_dir: Path, job_id: int, attempt: int) -> int | None:
    """The step of the followed checkpoint restored on this host for this attempt, if any."""
    marker = artifacts.attempt_dir(artifact_dir, job_id, attempt) / RESTORED_STEP_NAME
    try:
        return int(marker.read_text())
    except (OSError, ValueError):
        return None


class ScriptFollower:
    """Follows a running script's checkpoint file and TensorBoard scalars (rank 0 only; see
    the module docstring). ``start`` before the script starts, ``close`` after it ended.

    Args:
        root: the script's working directory (the workspace).
        restored_step: the step of the checkpoint restored before the script started.
    """

    def __init__(
        self,
        spec: JobSpec,
        env: RankEnv,
        artifact_dir: Path,
        root: Path,
        stop: StopFlag,
        restored_step: int | None = None,
    ) -> None:
        self._root, self._stop = root, stop
        self._held: list[Path] = []  # versions completed after a stop, or as the script ended
        self._child: subprocess.Popen[bytes] | None = None
        self._last_step = 0  # the newest scalar step seen
        self._checkpoint_step = restored_step or 0
        self._sink: Sink | None = None
        self._facts: AttemptFacts | None = None
        self._scalars: TensorBoardScalars | None = None
        self._files: FollowedFiles | None = None
        self._checkpointer: CheckpointSaver | None = None
        if spec.metrics is not None:
            dist = DistContext(
                env.rank, env.local_rank, env.world_size, torch.device("cpu"), spec.strategy, None
            )
            self._sink = make_sink(env, dist, artifact_dir=artifact_dir)
            self._facts = AttemptFacts(self._sink)
            logdir = root.joinpath(*spec.metrics.tensorboard.split("/"))
            self._scalars = TensorBoardScalars(logdir, within=root)
        if spec.checkpoints is not None:
            self._files = FollowedFiles(root, spec.checkpoints.path)
            self._checkpointer = make_checkpointer(
                env, artifact_dir, keep=spec.training.keep_checkpoints,
                transport=Settings().checkpoint_transport, stopping=stop.is_set,
            )  # fmt: skip
        self._done = threading.Event()
        self._warned_step0: set[str] = set()  # names whose step-0 scalar was told
        self._thread = threading.Thread(target=self._run, name="ddpq-follow", daemon=True)

    @property
    def active(self) -> bool:
        """Whether the spec names anything to follow."""
        return self._sink is not None or self._files is not None

    def start(self) -> None:
        """Start polling (a no-op when there is nothing to follow)."""
        if self.active:
            self._thread.start()

    def watch(self, child: subprocess.Popen[bytes]) -> None:
        """The script's process, once started: a version whose file closed as it ended is
        held until its exit code is known."""
        self._child = child

    def _script_ending(self) -> bool:
        """Whether a stop was asked for, or the script has ended (or is not running yet)
        within ``SETTLE_S`` of now: its last close may be its death's."""
        if self._stop.is_set() or self._child is None:
            return True
        if self._child.poll() is not None:
            return True
        time.sleep(SETTLE_S)
        return self._child.poll() is not None or self._stop.is_set()

    def _run(self) -> None:
        while not self._done.is_set():
            # A completed version wakes the loop at once: its copy starts before the script
            # can write the next one (and holds that write off while it copies).
            if self._files is not None:
                self._files.wait(RECHECK_S if self._files.rechecking else POLL_S)
            else:
                self._done.wait(POLL_S)
            if self._done.is_set():
                return
            try:
                self.poll()
            except Exception:  # a follower's bug must not end the rank: logged, next poll
                log.exception("following the script's files")

    def poll(self) -> None:
        """Read new scalars, then take new checkpoint versions (the scalars first, so a
        version's step counts the epoch it ends)."""
        if self._scalars is not None:
            self._take_scalars(self._scalars.poll())
        if self._files is not None:
            completed = self._files.completed()
            if completed and self._script_ending():
                self._held += [p for p in completed if p not in self._held]
            else:
                self._save(completed)

    def _save(self, paths: list[Path]) -> None:
        if self._checkpointer is None:
            return
        for path in paths:
            # A version the script replaced before its copy began still ended an epoch: it
            # keeps its step, and the newer one (taken on its own event) gets the next.
            step = max(self._last_step, self._checkpoint_step + 1)
            self._checkpoint_step = step
            version = self._files.completed_version(path) if self._files is not None else None
            name = relative_name(self._root, path)
            self._checkpointer.save_file(step, 0, path, name, version)

    def _take_scalars(self, scalars: list[Scalar]) -> None:
        sink, facts = self._sink, self._facts
        if sink is None or facts is None or not scalars:
            return
        for s in scalars:
            if not 1 <= s.step <= MAX_STEP:
                if s.name not in self._warned_step0:
                    self._warned_step0.add(s.name)
                    log.warning(
                        "TensorBoard scalar %r at global_step %d skipped: ddpq's steps are 1 to "
                        "2**53 - 1 (pass global_step=epoch + 1, or the optimizer step count)",
                        s.name, s.step,
                    )  # fmt: skip
                continue
            if not facts.began:
                facts.begin_at_report(s.step)
            sink.report_values(s.step, None, {s.name: s.value})
            self._last_step = max(self._last_step, s.step)
        sink.flush(Progress(self._last_step, None, None, None, None), average=False)

    def close(self, exit_code: int | None) -> None:
        """Stop polling, take what the script left (a last poll), write the points and wait
        for the checkpoint copies and uploads in flight (bounded as at a rank's end).

        Args:
            exit_code: how the script ended (negative: the signal that killed it; None: it
                did not start). Held versions are uploaded only when it exited 0.
        """
        if not self.active:
            return
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        try:
            self.poll()
            if self._held and exit_code == 0:
                self._save(self._held)
            elif self._held:
                names = ", ".join(relative_name(self._root, p) for p in self._held)
                log.warning(
                    "not taken as a checkpoint: %s, closed as the script ended with %s (it may "
                    "be cut short); the previous version stays the newest",
                    names, exit_code,
                )  # fmt: skip
        except Exception:
            log.exception("following the script's files (last look)")
        if self._files is not None:
            self._files.close()
        for closing in (self._sink, self._checkpointer):
            if closing is None:
                continue
            try:
                closing.close()
            except Exception:  # e.g. the last version could not be uploaded: an event says so
                log.exception("closing the script's follower")
