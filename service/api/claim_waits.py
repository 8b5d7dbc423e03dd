"""The worker API's long poll: claims that found nothing wait here until a job they could
claim may exist, without holding a database connection while they wait.

Two things wake a waiting claim: a submission through this API process (``notify``, at
once), and a probe that runs while claims wait: every ``PROBE_S`` seconds, one read per
distinct (launcher, GPUs) among the waiting claims, the same claim predicate the claim
itself and the queue explanation use (``count_claimable_jobs``). The probe finds what another
API process queued, a requeue by the reaper, a sweep slot freed. A submission wakes one
claim per key, and a woken claim that got a job wakes the next (``pass_on``): one claim
transaction per job queued here, however many workers wait. Jobs the probe still finds
claimable (a wake-up gone astray, jobs queued by another process) wake as many claims
waiting for their key as there are such jobs, not all of them: with 100 workers waiting on
each of two processes, a probe that saw a job submitted to the other process before its
claim committed ran 100 claim transactions for that one job. The database sees at most one
probe per key per ``PROBE_S`` per process.

A claim that arrives while the last probe for its key found nothing (within two probe
periods, and no submission here since) waits at once, without a claim transaction of its
own (``known_empty``): an idle fleet's long polls then cost the database one probe per key
per period, not one transaction per request. What such a claim could miss (a job queued by
another process or requeued) the next probe finds, as it does for the claims already waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

log = logging.getLogger(__name__)

PROBE_S = 0.1
# What a waiting claim can take: (launcher, GPUs per node it has free).
Key = tuple[str, int]


class ClaimWaits:
    """Waiting claims of one API process, first come first served per key, woken by
    ``notify`` or by the probe.

    A submission's wake-up goes to one waiting claim per key, not to all: a submission is
    usually one job, and every woken claim runs a claim transaction. A woken claim that got a
    job passes the wake-up on (``pass_on``), so a burst of jobs fans out to as many waiting
    claims as it needs; one that found nothing waits again. The probe, which sees what is
    still claimable ``probe_s`` later, wakes as many claims waiting for that key as it found
    claimable jobs.

    Args:
        probe: ``probe(launcher, max_gpus_per_node, limit)`` → how many jobs such a claim
            could find, counting at most ``limit`` (the claims waiting for the key; blocking,
            run in the threadpool). An error there is logged and counts as "none known".
        probe_s: seconds between probes while claims wait.
    """

    def __init__(self, probe: Callable[[str, int, int], int], probe_s: float = PROBE_S) -> None:
        self._probe = probe
        self._probe_s = probe_s
        self._waiting: dict[Key, deque[asyncio.Future[None]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # The loop's time of the last probe per key that found nothing, and of the last
        # submission here: see ``known_empty``.
        self._empty_at: dict[Key, float] = {}
        self._notified_at = float("-inf")

    def known_empty(self, key: Key) -> bool:
        """Whether the last probe for ``key`` found nothing claimable, at most two probe
        periods ago and after the last submission here: a claim for ``key`` may then wait
        at once (the probe still runs while it waits). Call it on the event loop."""
        at = self._empty_at.get(key)
        if at is None or at <= self._notified_at:
            return False
        return asyncio.get_running_loop().time() - at <= 2 * self._probe_s

    async def wait(self, key: Key, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for a wake-up meant for ``key``; whether one came."""
        loop = self._loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        queue = self._waiting.setdefault(key, deque())
        queue.append(future)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._probe_while_waiting())
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout_s)
            return True
        except TimeoutError:
            return future.done() and not future.cancelled()
        finally:
            if not future.done():
                future.cancel()
            with contextlib.suppress(ValueError):
                queue.remove(future)
            if not queue and self._waiting.get(key) is queue:
                del self._waiting[key]

    def pass_on(self, key: Key) -> None:
        """Wake the next claim waiting for ``key`` (a woken claim got a job: there may be
        more). Call it on the event loop."""
        self._wake(key)

    def notify(self) -> None:
        """Wake one waiting claim per key (a job was queued here). Safe from any thread."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._wake_each()
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._wake_each)

    def _wake(self, key: Key) -> bool:
        queue = self._waiting.get(key)
        while queue:
            future = queue.popleft()
            if not future.done():
                future.set_result(None)
                return True
        return False

    def _wake_each(self) -> None:
        if self._loop is not None:
            self._notified_at = self._loop.time()
        for key in list(self._waiting):
            self._wake(key)

    async def _probe_while_waiting(self) -> None:
        while self._waiting:
            await asyncio.sleep(self._probe_s)
            for key in list(self._waiting):
                probed_at = asyncio.get_running_loop().time()
                waiting = len(self._waiting.get(key, ()))
                if not waiting:
                    continue
                found: int | None
                try:
                    found = await run_in_threadpool(self._probe, *key, waiting)
                except Exception as exc:  # a database outage: the claims time out instead
                    log.debug("claim probe failed: %s", exc)
                    found = None
                if found == 0:
                    self._empty_at[key] = probed_at
                    continue
                self._empty_at.pop(key, None)
                # Still claimable a probe later: a wake-up went astray (its claim's client
                # left, it lost a race) or the jobs came from another process. One claim
                # looks per job found; one that gets it passes the wake-up on.
                for _ in range(found or 0):
                    if not self._wake(key):
                        break

    async def close(self) -> None:
        """Stop the probe (at the app's shutdown)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def claim_waits(app: FastAPI) -> ClaimWaits:
    """The app's ``ClaimWaits`` (``create_app`` puts one on ``app.state``)."""
    waits: ClaimWaits = app.state.claim_waits
    return waits
