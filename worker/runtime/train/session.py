"""A rank's ddpq services behind one object: metrics, checkpoints and the stop vote.

``RankSession`` is the one implementation behind both faces of ddpq inside a rank:
``TrainContext`` (built-in tasks and ``train(ctx)`` entrypoints) is a ``RankSession`` with the
model helpers added, and the ``ddpq`` library (``ddpq.report``, ``ddpq.save_checkpoint``,
``ddpq.should_stop`` ...) calls the rank's session: the one ``TrainContext`` of an entrypoint
rank, or one built from the environment in a command job's script
(``worker.runtime.script.session``). So there is one sink (batched, spilled, exactly once,
fenced), one checkpointer (async snapshot, atomic write, sha256, upload) and one stop vote.

Rank-0 discipline is built in: every rank may call ``report_metrics`` and ``save_checkpoint``; only
rank 0's calls are recorded (``make_sink`` / ``make_checkpointer`` give the other ranks null
objects). ``should_stop`` and ``load_checkpoint`` are collectives: every rank calls them at
the same point.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, SupportsIndex

import torch

from ddpq._state import Info
from service.core.metrics.points import checked_report
from service.core.spec.model import JobSpec
from service.core.wire.attempt import AttemptSelf, InitFrom
from worker.runtime.attempt_client import AttemptClient
from worker.runtime.checkpoints.fetch import StartPoint, agree_on_start
from worker.runtime.checkpoints.files import load_checkpoint_file
from worker.runtime.checkpoints.saver import CheckpointSaver
from worker.runtime.distributed import DistContext, StopVote, all_reduce_sum_
from worker.runtime.metrics.buffer import Sink
from worker.runtime.signals import StopFlag
from worker.runtime.timeline import AttemptFacts
from worker.runtime.train.nonfinite import REPORTED_LOSS, NonFinitePolicy, first_nonfinite
from worker.runtime.train.progress import ProgressClock
from worker.runtime.watchdog import NullWatchdog, StallWatchdog

log = logging.getLogger(__name__)
MetricValue = float | int | torch.Tensor


class RankSession:
    """One rank's services: see the module docstring.

    Attributes:
        spec, rank, local_rank, world_size, device, job_id, attempt: the rank's job and place.
        dist, sink, checkpointer, stop_flag, watchdog, nonfinite, clock, facts: the services,
            for the built-in trainer (``worker.runtime.train.trainer``).
        last_step, last_epoch: the newest step and epoch reported or saved.
        total_steps: for progress and ETA (``training.max_steps`` until set).
        stopped: whether ``should_stop`` answered True.
    """

    def __init__(
        self,
        *,
        spec: JobSpec,
        dist: DistContext,
        sink: Sink,
        checkpointer: CheckpointSaver,
        stop: StopFlag,
        api: AttemptClient | None,
        artifact_dir: Path,
        job_id: int,
        attempt: int,
        watchdog: StallWatchdog | None = None,
        attempt_self: AttemptSelf | None = None,
    ) -> None:
        self.spec = spec
        # GET /attempts/self at start (None: the API could not be asked): its init_from.
        self._attempt_self = attempt_self
        self._start: StartPoint | None = None
        self._start_agreed = False
        self.rank, self.local_rank, self.world_size = dist.rank, dist.local_rank, dist.world_size
        self.device, self.job_id, self.attempt = dist.device, job_id, attempt
        self.dist, self.sink, self.checkpointer, self.stop_flag = dist, sink, checkpointer, stop
        self.watchdog: StallWatchdog | NullWatchdog = (
            watchdog if watchdog is not None else NullWatchdog()
        )
        self.nonfinite = NonFinitePolicy(spec.training.nonfinite_loss, dist.rank)
        self.clock = ProgressClock()
        # The resume step, restore time, start and checkpoint stall rank 0 tells the API.
        self.facts = AttemptFacts(sink)
        self._api, self._artifact_dir = api, artifact_dir
        self._vote: StopVote | None = None
        self.last_step = 0
        self.last_epoch: int | None = None
        self.total_steps: int | None = spec.training.max_steps
        self.stopped = False
        self._known_names: set[str] = set()  # names ``report`` checked already
        self._check_losses = self.nonfinite.checks_reports
        self._warned_skip = False

    # -- metrics -------------------------------------------------------------------------------
    def report_metrics(
        self,
        step: SupportsIndex,
        epoch: SupportsIndex | None = None,
        metrics: Mapping[str, MetricValue] | None = None,
        *,
        mean: bool = False,
    ) -> None:
        """Record ``metrics`` at global ``step`` (1-based).

        Tensors stay on their device until a batch is flushed (no host sync per call); floats
        are taken as they are. Only rank 0's values are kept, unless ``mean``: then every rank
        must make the same call, the values are averaged over the ranks first (one all_reduce
        and one host sync per call) and the points say they are means over ``world_size``
        ranks. A repeated (name, step) is ignored.

        ``training.nonfinite_loss: fail`` applies to the metric ``loss`` on every rank: a
        float is checked at this call; a tensor when its batch is flushed (the flush copies
        it to the host anyway): at the first report, then within ``FLUSH_EVERY_POINTS`` tensor
        reports or ``FLUSH_INTERVAL_S`` seconds (``worker.runtime.metrics.buffer``) of the bad
        step, or at the latest at ``close``. The points up to it are recorded first.

        Raises:
            ValueError: a step below 1 or past 2**53 - 1, an epoch outside 0..2**31 - 1, or a
                metric name over 100 characters (``service.core.metrics.points.checked_report``).
            NonFiniteLossError: a NaN/inf ``loss`` with ``training.nonfinite_loss: fail``.
        """
        metrics = metrics or {}
        step, epoch = checked_report(step, epoch, metrics, self._known_names)
        for name, value in metrics.items():  # before anything is kept or told
            if isinstance(value, torch.Tensor) and value.numel() != 1:  # metadata: no sync
                raise ValueError(
                    f"metric {name!r}: a tensor of shape {tuple(value.shape)}; report one "
                    "number (e.g. loss.mean())"
                )
        if not self.facts.began:  # before the first point: its resume step goes first
            self.facts.begin_at_report(step)
        sink = self.sink
        if mean:
            averaged = self._mean_over_ranks(metrics)
            sink.report_values(step, epoch, averaged, reduced=True)
            if REPORTED_LOSS in averaged and self._check_losses:
                self.nonfinite.check_reported(step, averaged[REPORTED_LOSS])
        else:
            for name, value in metrics.items():
                if isinstance(value, torch.Tensor):
                    sink.report(step, epoch, value, name)
                else:
                    sink.report_values(step, epoch, {name: value})
                    if name == REPORTED_LOSS and self._check_losses:
                        self.nonfinite.check_reported(step, float(value))
        if step > self.last_step:
            self.last_step = step
        if epoch is not None:
            self.last_epoch = epoch
        if not self._check_losses and not self._warned_skip and REPORTED_LOSS in metrics:
            self._warn_skip_not_applied()
        self.watchdog.step_finished(self.last_step)  # a step finished (the first call starts it)
        if sink.flush_due() or sink.time_due():
            self.flush()

    def _mean_over_ranks(self, metrics: Mapping[str, MetricValue]) -> dict[str, float]:
        """The values averaged over every rank: one all_reduce of them stacked."""
        names = list(metrics)
        if not names:
            return {}
        values = [
            v.detach().reshape(()).to(self.device, torch.float64)
            if isinstance(v, torch.Tensor)
            else torch.tensor(float(v), dtype=torch.float64, device=self.device)
            for v in metrics.values()
        ]
        stacked = torch.stack(values)
        all_reduce_sum_(stacked, self.collective_dist())
        means = (stacked / self.world_size).tolist()
        return dict(zip(names, (float(m) for m in means), strict=True))

    def flush(self) -> None:
        """Hand buffered metrics to the writer now (rank 0; no collective).

        Raises:
            NonFiniteLossError: a buffered tensor ``loss`` was NaN/inf with
                ``training.nonfinite_loss: fail`` (after the batch was handed over).
        """
        bad = first_nonfinite(self.sink.buffered(REPORTED_LOSS)) if self._check_losses else None
        progress = self.clock.progress(self.last_step, self.total_steps, self.last_epoch)
        self.sink.flush(progress, average=False)
        if bad is not None:
            self.nonfinite.check_reported(*bad)

    # -- stopping ------------------------------------------------------------------------------
    def collective_dist(self) -> DistContext:
        """The process group facts collectives use (a script's session resolves them at its
        first collective: the script sets up its own process group)."""
        return self.dist

    def local_stop(self) -> bool:
        """This rank's own reason to stop, not yet agreed with its peers: a signal (cancel,
        preemption) or a fenced-off write (the attempt is stale)."""
        signalled = self.stop_flag.seen_at_step_boundary()  # called at every step boundary
        return signalled or self.sink.should_stop() or self.checkpointer.should_stop()

    @property
    def vote(self) -> StopVote:
        """The stop vote (made at the first use, over ``collective_dist``)."""
        if self._vote is None:
            self._vote = StopVote(self.collective_dist())
        return self._vote

    def should_stop(self) -> bool:
        """True when the job must stop (cancel, preemption, worker shutdown, or this attempt
        was fenced off); every rank gets the same answer at the same call, one call after the
        first rank saw the reason. Call once per step on every rank; after True, save a
        checkpoint and return."""
        self.watchdog.step_finished(self.last_step)
        if self.vote.poll(self.local_stop(), False).stop:
            self.stopped = True
        return self.stopped

    # -- checkpoints ---------------------------------------------------------------------------
    @property
    def init_from(self) -> InitFrom | None:
        """The spec's ``init_from`` as the API resolved it (source job, step, ``mode``), when
        known; it applies only while the job has no checkpoint of its own."""
        return self._attempt_self.init_from if self._attempt_self is not None else None

    def agree_on_start(self) -> StartPoint | None:
        """Where this rank starts, the same on every rank: this job's newest intact checkpoint
        (``kind`` ``resume``), else its ``init_from`` checkpoint (``kind`` ``init``), fetched
        onto this host if need be; None on a fresh start. A collective, decided once (later
        calls return the same answer without one).

        Raises:
            CheckpointFetchError: a node could not get the chosen file (on every rank).
        """
        if not self._start_agreed:
            with self.facts.restoring():
                self._start = agree_on_start(
                    self.collective_dist(), self._api, self._artifact_dir, self.job_id,
                    self.attempt, self._attempt_self,
                )  # fmt: skip
            self._start_agreed = True
            # The attempt's resume step (told to the API when training begins: ``facts``):
            # an init_from start resumes nothing of this job's own, so earlier attempts'
            # points are all superseded.
            start = self._start
            self.facts.resume_step = start.step if start is not None else 0
        return self._start

    def agree_on_resume(self) -> Path | None:
        """The newest intact checkpoint of this job (any attempt), the same on every rank;
        None on a fresh start or an ``init_from`` start. A collective."""
        start = self.agree_on_start()
        return start.path if start is not None and start.kind == "resume" else None

    def save_checkpoint(self, state: Any, step: int, epoch: int = 0) -> None:
        """Checkpoint ``state`` (any picklable object; tensors are copied to host buffers now)
        at ``step``; the file is written, hashed and recorded or uploaded in the background
        (rank 0 only). A second save of the same step is ignored.

        Raises:
            ValueError: ``step`` or ``epoch`` out of range (``checked_report``'s rules).
        """
        step, checked_epoch = checked_report(step, epoch, ())
        epoch = checked_epoch if checked_epoch is not None else 0
        self.flush()  # the points reported so far are stored before the checkpoint counts
        with self.watchdog.pause(), self.facts.checkpoint_stall():  # a slow disk: no stall
            self.checkpointer.save(step, epoch, lambda: state)
        self.last_step = max(self.last_step, step)
        self.watchdog.step_finished(self.last_step)

    def load_checkpoint(self, map_location: torch.device | str | None = None) -> Any:
        """The newest intact checkpoint of this job (any attempt), loaded onto ``map_location``
        (default ``device``); None on a fresh start. A collective: every rank loads the same
        one. Training counts as begun from here (the resume step is told to the API).

        A job without a checkpoint of its own but with ``init_from`` gets the source job's
        checkpoint: whole with mode ``full``; with ``weights_only`` only its ``"model"``
        entry (``{"model": ...}``: no optimizer, no step, so the loop starts at step 1).

        Raises:
            CheckpointFetchError: the chosen checkpoint could not be brought onto this host.
        """
        start = self.agree_on_start()
        if start is None:
            self.facts.begin(0)
            return None
        with self.facts.restoring():
            state = load_checkpoint_file(
                start.path,
                torch.device(map_location) if map_location is not None else self.device,
                any_object=True,
            )
        if start.kind == "init" and start.mode == "weights_only":
            whole = state if isinstance(state, dict) else {}
            state = {"model": whole["model"]} if "model" in whole else {}
        step = state.get("step", 0) if isinstance(state, dict) else 0
        self.clock.restart(int(step or 0) if isinstance(step, int) else 0)
        self.facts.begin(self.facts.resume_step or 0)
        return state

    # -- what the ddpq library reads -----------------------------------------------------------
    def config_values(self) -> dict[str, Any]:
        """The spec's ``config`` object (a copy)."""
        return dict(self.spec.config)

    @property
    def resumed_from_step(self) -> int | None:
        """The checkpoint step this attempt started from, once known (None: a fresh start, or
        not agreed on yet)."""
        step = self.facts.resume_step
        return step if step else None

    def info(self) -> Info:
        """This rank's job, attempt and place (``ddpq.info()``)."""
        return Info(
            under_ddpq=True, job_id=self.job_id, attempt=self.attempt, rank=self.rank,
            local_rank=self.local_rank, world_size=self.world_size,
            resumed_from_step=self.resumed_from_step, seed=self.spec.training.seed,
        )  # fmt: skip

    def _warn_skip_not_applied(self) -> None:
        self._warned_skip = True
        log.warning(
            "training.nonfinite_loss=skip_step does not apply to a custom loop: ddpq does not "
            "run its optimizer step, so non-finite losses are recorded as they are (use 'fail' "
            "to stop the job on one, or skip the step in the loop)"
        )

    def close(self) -> None:
        """Flush what is buffered and settle the last stop vote (after the loop returns).

        Raises:
            NonFiniteLossError: see ``flush``.
        """
        try:
            if self.sink.pending or self.last_step != self.clock.mark_step:
                self.flush()
        finally:
            if self._vote is not None:
                self._vote.close()
