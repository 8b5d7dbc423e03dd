"""The worker loop: heartbeat → reconcile → watch (poll, cancel) → finish → claim → launch.

Plan, then act: every state change is first a ``Decision`` made by a pure function of what
the worker observed (``decide_on_status`` and friends, in ``worker.decisions``);
``WorkerLoop`` applies it through its ``worker.control.records.WorkerRecords`` (one API call
each). The loop knows a launcher only through the ``worker.launchers.base.Launcher``
interface and the launcher's row in ``service.core.launchers.LAUNCHER_TRAITS``:
``host_gpus`` (hand out this host's GPUs, bound to a plan by ``Launcher.bind_gpus``),
``detached`` and ``adopts``.

A detached launcher (Slurm) runs jobs that outlive the worker: the loop records each start's
handle as the job's ``scheduler_job_id``, and on a clean shutdown leaves its jobs running for
the next worker to adopt instead of cancelling them. A launcher that ``adopts`` takes over
such jobs from lost or stopped workers on every tick (the worker API's adoptions) and follows
them by their ``scheduler_job_id``. A launcher that starts arrays (``ArrayStarter``: Slurm)
gets a sweep's trials in batches, one claim and one array per batch (``worker.launches``).

The lease fence (``worker.control.fences``): a worker that cannot reach the control plane
stops a job's ranks before a lease it could not renew can lapse, so the job never runs here
while the API requeues it elsewhere. The first heartbeat that gets through requeues such a
job if the API still lists it as held here (an orphan of ``reconcile``). A clean shutdown is
``worker.control.shutdown``'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from service.core.config import Settings
from service.core.errors import (
    ControlPlaneUnavailableError,
    NotFoundError,
    StaleStateError,
    WorkerTokenMismatchError,
    WorkerTokenRefusedError,
)
from service.core.holds import ClaimedJob, ClaimedJobs
from service.core.launchers import launcher_traits
from worker.attempt_notes import PendingReasons, post_status_notes, usable_cpus
from worker.control.fences import LeaseFence
from worker.control.records import WorkerRecords
from worker.control.shutdown import shut_down
from worker.decisions import (
    Decision,
    GpuPool,
    HeldRun,
    decide_on_launch_error,
    decide_on_status,
    reconcile,
)
from worker.launchers.base import (
    ArrayStarter,
    BatchPoller,
    Launcher,
    RunStatus,
)
from worker.launches import Launches

log = logging.getLogger(__name__)

MAX_TICK_S = 1.0
MAX_BACKOFF_S = 30.0
# The longest one claim waits for a job (a long poll), so a stop is seen this soon.
MAX_CLAIM_WAIT_S = 1.0


def _jlog(level: int, run: HeldRun, msg: str, *args: Any) -> None:
    fields = {"job_id": run.job_id, "attempt": run.attempt}
    log.log(level, "job_id=%d attempt=%d " + msg, run.job_id, run.attempt, *args, extra=fields)


class WorkerLoop:
    """One worker (``records.worker_id``): holds up to ``slots`` jobs at once on one launcher,
    and reaches the control plane only through ``records``.

    The launcher's traits (``service.core.launchers``) decide whether this worker hands out
    its own ``gpus`` to jobs (``host_gpus``: the local launcher); otherwise GPU placement is
    the backend's business (Slurm). Jobs adopted from other workers count against ``slots``
    like claimed ones.

    ``clock`` is the monotonic clock (seconds) the loop times ticks and leases with; tests
    pass a fake one.

    Raises:
        KeyError: the launcher's name has no row in ``LAUNCHER_TRAITS``.
    """

    def __init__(
        self,
        settings: Settings,
        records: WorkerRecords,
        launcher: Launcher,
        *,
        host: str,
        pid: int,
        slots: int = 1,
        gpus: list[int] | None = None,
        cpus: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.records = records
        self.launcher = launcher
        self.worker_id = records.worker_id
        self.host = host
        self.pid = pid
        self.slots = max(1, slots)
        self.gpu_ids = list(gpus or [])
        self.pool = GpuPool(self.gpu_ids)
        self.cpus = cpus or usable_cpus()  # cores ranks of a host launcher share
        self.pending = PendingReasons()
        traits = launcher_traits(launcher.name)
        self.host_gpus = traits.host_gpus
        self.detached = traits.detached
        self.adopts = traits.adopts
        self.runs: dict[int, HeldRun] = {}
        self.launches = Launches(
            launcher, lambda: self.records, self.pool, self.host_gpus, self.detached, self.cpus
        )
        self.registered = False
        self.stopping = False
        # The API refused this worker's token (revoked, unknown, or the id is another
        # token's): no call can succeed, so the loop ends and shutdown calls nothing.
        self.refused = False
        self._heartbeat_sent: float | None = None  # clock() of the last heartbeat answered
        self.fence = LeaseFence(
            launcher, clock, detached=self.detached, call_timeout_s=records.call_timeout_s
        )

    @property
    def tick_s(self) -> float:
        """Seconds between ticks: the heartbeat interval, at most ``MAX_TICK_S``."""
        return min(self.settings.heartbeat_interval_s, MAX_TICK_S)

    @property
    def lease_s(self) -> float:
        """A lease's length (seconds) as the control plane grants it (each answer says)."""
        return self.records.lease_s

    @property
    def stop_budget_s(self) -> float:
        """Seconds before a lease could lapse by which this worker stops a job it could not
        renew (``LeaseFence.budget_s``)."""
        return self.fence.budget_s(self.lease_s, self.tick_s)

    @property
    def max_backoff_s(self) -> float:
        """Longest wait between failing ticks (seconds): at most a quarter of the lease, so
        after a short outage the leases are renewed before anyone requeues the jobs."""
        return max(self.tick_s, min(MAX_BACKOFF_S, self.lease_s / 4))

    def register(self) -> None:
        """Insert (or revive) this worker's row."""
        capacity = {"slots": self.slots, "gpus": self.gpu_ids, "cpus": self.cpus}
        self.records.register(host=self.host, pid=self.pid, capacity=capacity)
        self.registered = True
        log.info("worker %s registered: launcher=%s slots=%d gpus=%s",
                 self.worker_id, self.launcher.name, self.slots, self.gpu_ids)  # fmt: skip

    def run(self, stop: threading.Event) -> None:
        """Tick until ``stop`` is set, then shut down cleanly.

        A refused worker token (revoked, unknown, or the id registered by another token) ends
        the worker: its attached jobs' ranks are stopped at once and the error is raised. Any
        other failing tick (an API outage, or any error: logged with its traceback) never ends
        the worker: it is retried with exponential backoff up to ``max_backoff_s`` seconds,
        running jobs left alone while their leases surely hold. Before every tick, jobs whose
        lease was not renewed in time are fenced (``fence_lapsing_runs``); no wait lasts past
        the next fence deadline, and a failing loop tries once more a tick before it. The
        first tick that succeeds reconciles: its heartbeat renews the leases still held,
        stops the ranks of jobs requeued or ended elsewhere and requeues jobs held here that
        no longer run (fenced ones included).
        """
        backoff = self.tick_s
        failing_since: float | None = None  # clock() when ticks started to fail
        try:
            while not stop.is_set():
                self.fence_lapsing_runs()
                try:
                    self.tick(claim=False)  # the pause below claims, in a long poll
                    if failing_since is not None:
                        log.info("ticks succeed again after %.1f s; holding jobs %s",
                                 self.clock() - failing_since, sorted(self.runs))  # fmt: skip
                    backoff, failing_since = self.tick_s, None
                    self._pause(stop, self._until_fence_s(self.tick_s))
                    continue
                except (WorkerTokenRefusedError, WorkerTokenMismatchError) as exc:
                    # No retry can succeed: a revoked token stays refused, and a worker id
                    # stays with the token that registered it.
                    log.error("%s; this worker stops (its jobs' ranks now)", exc.detail)
                    self.refused = True
                    raise
                except Exception as exc:
                    if failing_since is None:
                        failing_since = self.clock()
                    wait = self._until_fence_s(backoff)
                    backoff = min(backoff * 2, self.max_backoff_s)
                    if isinstance(exc, ControlPlaneUnavailableError):
                        log.warning("API unavailable (%s); retrying in %.1f s", exc, wait)
                    else:
                        log.exception("worker tick failed; retrying in %.1f s", wait)
                stop.wait(wait)
        finally:
            self.shutdown()

    def _until_fence_s(self, wait_s: float) -> float:
        """``wait_s`` cut at the runs' fence (``LeaseFence.until_s``)."""
        return self.fence.until_s(self.runs, wait_s, lease_s=self.lease_s, tick_s=self.tick_s)

    def fence_lapsing_runs(self) -> list[int]:
        """Stop the ranks of every held job whose lease this worker did not renew in time
        and forget it here, its GPUs given back (``LeaseFence.stop_lapsing``: no call to the
        control plane). Returns the fenced job ids."""
        runs = self.fence.stop_lapsing(self.runs, lease_s=self.lease_s, tick_s=self.tick_s)
        for run in runs:
            self.forget(run)
        return [run.job_id for run in runs]

    def _pause(self, stop: threading.Event, wait_s: float) -> None:
        """Wait ``wait_s`` seconds for the next tick. While a slot is free, wait in a long
        poll on the claim instead (the API answers as soon as a job this worker can run is
        queued) and launch what it returns at once. An error here ends the pause early; the
        tick reports it."""
        deadline = self.clock() + wait_s
        while (left := deadline - self.clock()) > 0 and not stop.is_set():
            if self.stopping or len(self.runs) >= self.slots:
                stop.wait(left)
                return
            try:
                self._claim_and_launch(wait_s=min(left, MAX_CLAIM_WAIT_S))
            except Exception as exc:
                if isinstance(exc, (ControlPlaneUnavailableError, WorkerTokenRefusedError,
                                    WorkerTokenMismatchError, NotFoundError)):  # fmt: skip
                    log.debug("claim failed (%s); the next tick retries", exc)
                else:  # a launch or its first watch: as a failing tick's is
                    log.exception("worker tick failed while claiming; the next tick retries")
                # The next tick heartbeats (an idle one may not), so a failing API meets the
                # loop's backoff, a refused token ends the worker and a lost row re-registers,
                # instead of claiming again at once.
                self._heartbeat_sent = None
                stop.wait(max(0.0, deadline - self.clock()))
                return

    @property
    def _max_gpus(self) -> int:
        """GPUs per node a job may ask for now: the free ones here, or (Slurm, no host GPUs)
        the deployment's cap."""
        return self.pool.free if self.host_gpus else self.settings.max_gpus_per_node

    def tick(self, *, claim: bool = True) -> None:
        """One round: heartbeat, reconcile, adopt (a launcher that ``adopts``), watch every
        held job, claim (unless not ``claim``: ``run``'s pause claims next, in a long poll).
        (The API's reaper requeues lost workers' jobs; adoption leaves a detached job to it
        only once no worker of its launcher takes it over.)

        Raises:
            ControlPlaneUnavailableError: the API could not be reached (nothing is killed).
        """
        if not self.registered:
            self.register()
        if self.runs or self._idle_heartbeat_due():
            self._heartbeat()
        if self.adopts:
            self._adopt()
        self.watch_all()
        if claim and not self.stopping:
            self._claim_and_launch()

    def shutdown(self) -> None:
        """Stop claiming and end the held jobs as the launcher calls for
        (``worker.control.shutdown.shut_down``)."""
        shut_down(self)

    # -- steps of a tick ---------------------------------------------------------------

    def _idle_heartbeat_due(self) -> bool:
        """A worker holding no job has no lease to renew: it tells the API it is alive
        every ``heartbeat_interval_s`` seconds, not every tick (an idle fleet's requests)."""
        last = self._heartbeat_sent
        return last is None or self.clock() - last >= self.settings.heartbeat_interval_s

    def _heartbeat(self) -> None:
        # Taken before sending: the API renews the leases at some moment after this one, so
        # a reply that comes late never makes the fence believe a lease lasts longer.
        sent = self.clock()
        try:
            held = self.records.heartbeat()
        except NotFoundError:
            log.warning("worker %s was not registered; registering again", self.worker_id)
            self.register()
            return
        self._heartbeat_sent = sent
        plan = reconcile(self.runs, held)
        for job_id in plan.lost:
            run = self.runs[job_id]
            adopter = self._adopter(run)
            if adopter is not None:
                _jlog(logging.WARNING, run, "adopted by worker %s; leaving it running", adopter)
            else:
                _jlog(logging.WARNING, run, "no longer held by this worker; stopping it")
                if run.handle is not None:
                    self.launcher.cancel(run.handle)
            self.forget(run)
        for run in self.runs.values():  # every run left is held there: its lease renewed
            run.renewed_mono = sent
        for job_id, state in plan.states.items():
            self.runs[job_id].state = state
        for job_id in plan.cancel_requested:
            self.runs[job_id].cancel_requested = True
        for decision in plan.orphans:
            log.warning("job_id=%d held but not running here; requeueing", decision.job_id)
            self.apply(None, decision)

    def _adopter(self, run: HeldRun) -> str | None:
        """The worker that adopted ``run``'s attempt (still active there), if any: its
        detached job must keep running. None when the job was requeued or ended instead."""
        if not self.detached or run.handle is None:
            return None
        return self.records.adopter_of(run.job_id, run.attempt)

    def _adopt(self) -> None:
        """Follow the detached jobs of lost or stopped workers (by their scheduler_job_id)."""
        sent = self.clock()
        for job in self.records.adopt():
            self.runs[job.job_id] = run = HeldRun.adopted(job, renewed_mono=sent)
            # The API logs it too, but an operator reads the worker's own log.
            title = launcher_traits(self.launcher.name).title or self.launcher.name
            _jlog(logging.INFO, run, "adopted %s job %s from worker %s", title,
                  job.scheduler_job_id, job.previous_worker_id)  # fmt: skip

    def watch_all(self) -> None:
        """Watch every held job; pending cancels first, then one batched poll where the
        launcher supports it (Slurm: one sacct per tick for all of them)."""
        runs = list(self.runs.values())
        for run in runs:
            self._send_cancel(run)
        handles = [r.handle for r in runs if r.handle is not None]
        statuses: dict[str, RunStatus] = {}
        if handles and isinstance(self.launcher, BatchPoller):
            statuses = self.launcher.poll_many(handles)
        self.pending.record_changes(self.launcher, self.records, runs, statuses)
        for run in runs:
            if self.runs.get(run.job_id) is run:
                self._watch(run, statuses.get(run.handle or ""))

    def _send_cancel(self, run: HeldRun) -> None:
        if run.handle is not None and run.cancel_requested and not run.cancel_sent:
            _jlog(logging.INFO, run, "cancel requested; stopping its processes")
            self.launcher.cancel(run.handle)
            run.cancel_sent = True

    def _watch(self, run: HeldRun, status: RunStatus | None = None) -> None:
        """Act on one held job: fail a launch error, send a pending cancel, apply what its
        ``status`` (polled here when not given) calls for."""
        if run.handle is None:
            self.apply(run, decide_on_launch_error(run, run.launch_error or "not started"))
            return
        if run.cancel_requested and not run.cancel_sent:
            self._send_cancel(run)
            status = None  # observe the job after the cancel
        status = status or self.launcher.poll(run.handle)
        post_status_notes(self.records, run, status)
        decision = decide_on_status(run, status)
        if decision is not None:
            self.apply(run, decision)

    def _claim_and_launch(self, wait_s: float = 0.0) -> None:
        """Claim and start jobs while slots are free: a launcher that starts arrays takes a
        sweep's trials in batches (one claim, one array per batch), others as many jobs as
        ``_claim_limit`` allows per claim, each started on its own. The first claim may wait
        up to ``wait_s`` seconds for a job (a long poll)."""
        while len(self.runs) < self.slots:
            free = self.slots - len(self.runs)
            sent = self.clock()  # a claim leases its jobs for lease_s from a moment after this
            batch: ClaimedJobs | None = None
            if isinstance(self.launcher, ArrayStarter):
                batch = self.records.claim_batch(self._max_gpus, free, wait_s)
                jobs: tuple[ClaimedJob, ...] = batch.jobs if batch is not None else ()
            elif (limit := self._claim_limit(free)) > 1:
                jobs = tuple(self.records.claim_many(self._max_gpus, limit, wait_s))
            else:
                one = self.records.claim(self._max_gpus, wait_s)
                jobs = (one,) if one is not None else ()
            if not jobs:
                return
            wait_s = 0.0  # a job came: take what else is queued without waiting
            claimed = [(HeldRun.claimed(job, renewed_mono=sent), job.spec) for job in jobs]
            for run, _ in claimed:
                self._hold(run)
            if batch is not None and batch.sweep_id is not None:
                self.launches.start_arrays(claimed, parallelism=batch.max_concurrent)
            else:
                for run, spec in claimed:
                    self.launches.start_one(run, spec)
            for run, _ in claimed:
                if self.runs.get(run.job_id) is run:
                    self._watch(run)

    def _claim_limit(self, free: int) -> int:
        """Jobs one claim may take with ``free`` slots: all of them, unless this worker hands
        out its own GPUs and has some free: each job claimed may ask for every free GPU, so
        two claimed at once could need more than there are."""
        return 1 if self.host_gpus and self.pool.free > 0 else free

    def _hold(self, run: HeldRun) -> None:
        """Take a claimed run into ``runs`` (stopping a stale copy of the job, if any)."""
        stale = self.runs.get(run.job_id)
        if stale is not None and stale.handle is not None:
            self.launcher.cancel(stale.handle)
        self.runs[run.job_id] = run
        _jlog(logging.INFO, run, "claimed")

    def apply(self, run: HeldRun | None, decision: Decision) -> bool:
        """Apply ``decision``; False when the job had moved on (logged, not fatal)."""
        t = decision.transition
        try:
            applied = self.records.apply(t, error=decision.error, values=decision.values)
        except StaleStateError as exc:
            log.warning("job_id=%d: %s; the next heartbeat reconciles", t.job_id, exc)
            return False
        log.info("job_id=%d %s → %s (%s)", t.job_id, t.expected, applied, t.reason,
                 extra={"job_id": t.job_id})  # fmt: skip
        if run is not None:
            run.state = applied
            if decision.releases:
                self.forget(run)
        return True

    def forget(self, run: HeldRun) -> None:
        self.pool.give(run.gpus)
        run.gpus = ()
        self.runs.pop(run.job_id, None)
