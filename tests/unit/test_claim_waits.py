"""The long poll's waiting room (service.api.claim_waits): a submission wakes one waiting claim
per key, a woken claim that got a job wakes the next, the probe wakes one claim of a key per
job it finds for it (never more than wait), and a wait that nobody wakes ends empty. Driven
on an asyncio loop with a fake probe (our own interface); no database, no server."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from service.api.claim_waits import ClaimWaits

LOCAL = ("local", 0)
GPU = ("local", 2)


async def _waiters(waits: ClaimWaits, key: tuple[str, int], n: int) -> list[asyncio.Task[bool]]:
    tasks = [asyncio.create_task(waits.wait(key, 5.0)) for _ in range(n)]
    await asyncio.sleep(0.01)  # all waiting now
    return tasks


def test_a_submission_wakes_one_claim_per_key_and_a_winner_passes_it_on() -> None:
    async def scenario() -> None:
        waits = ClaimWaits(lambda launcher, gpus, limit: 0, probe_s=60.0)
        local = await _waiters(waits, LOCAL, 3)
        gpu = await _waiters(waits, GPU, 1)
        waits.notify()
        await asyncio.sleep(0.01)
        assert [t.done() for t in local] == [True, False, False], "the oldest claim only"
        assert gpu[0].done(), "one per key"
        waits.pass_on(LOCAL)  # the woken claim got a job: the next one looks
        await asyncio.sleep(0.01)
        assert [t.done() for t in local] == [True, True, False]
        assert all(t.result() for t in local[:2])
        local[2].cancel()
        await waits.close()

    asyncio.run(scenario())


def test_the_probe_wakes_a_claim_only_for_keys_with_work() -> None:
    async def scenario() -> None:
        asked: list[tuple[str, int]] = []

        def probe(launcher: str, gpus: int, limit: int) -> int:
            asked.append((launcher, gpus))
            return limit if gpus == 2 else 0

        waits = ClaimWaits(probe, probe_s=0.02)
        local = await _waiters(waits, LOCAL, 2)
        gpu = await _waiters(waits, GPU, 2)
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in local), "no work for CPU-only claims"
        assert all(t.done() and t.result() for t in gpu), "a job for each: all of them look"
        assert set(asked) == {LOCAL, GPU}
        for t in [*local, *gpu]:
            t.cancel()
        await waits.close()

    asyncio.run(scenario())


def test_a_wait_nobody_wakes_ends_empty_and_leaves_no_waiter() -> None:
    async def scenario() -> None:
        waits = ClaimWaits(lambda launcher, gpus, limit: 0, probe_s=60.0)
        assert await waits.wait(LOCAL, 0.05) is False
        waits.notify()  # nobody waits: nothing to wake, nothing kept for later
        assert await waits.wait(LOCAL, 0.05) is False
        await waits.close()

    asyncio.run(scenario())


async def _eventually(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Wait until ``predicate()`` holds, yielding to the loop (a loaded box delays the probe
    task by more than its period, so a fixed sleep is not enough); fail after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting: {what}"
        await asyncio.sleep(0.005)


def test_a_key_is_known_empty_only_after_a_probe_found_nothing_and_no_submission_since() -> None:
    async def scenario() -> None:
        work = {LOCAL: 0, GPU: 1}
        waits = ClaimWaits(lambda launcher, gpus, limit: work[(launcher, gpus)], probe_s=0.02)
        assert not waits.known_empty(LOCAL), "no probe yet: the claim must look itself"
        local = await _waiters(waits, LOCAL, 1)
        gpu = await _waiters(waits, GPU, 1)
        await _eventually(lambda: waits.known_empty(LOCAL), "a probe to find LOCAL empty")
        assert not waits.known_empty(GPU), "the probe found work for it"
        waits.notify()  # a submission here (it wakes the waiting claim): a new one must look
        assert not waits.known_empty(LOCAL)
        local += await _waiters(waits, LOCAL, 1)
        await _eventually(lambda: waits.known_empty(LOCAL), "the probe to run again")
        for t in [*local, *gpu]:
            t.cancel()
        await waits.close()
        # No probe runs now: what it found grows old.
        await _eventually(lambda: not waits.known_empty(LOCAL), "older than two probe periods")

    asyncio.run(scenario())


def test_the_probe_wakes_one_claim_per_job_it_finds_not_every_waiting_claim() -> None:
    async def scenario() -> None:
        limits: list[int] = []

        def probe(launcher: str, gpus: int, limit: int) -> int:
            limits.append(limit)
            # Two jobs queued by another API process, taken before the next probe.
            return min(2, limit) if len(limits) == 1 else 0

        waits = ClaimWaits(probe, probe_s=0.02)
        local = await _waiters(waits, LOCAL, 5)
        await asyncio.sleep(0.05)  # a few probes
        woken = [t for t in local if t.done()]
        assert len(woken) == 2, (
            f"{len(woken)} of 5 waiting claims woken for 2 claimable jobs: expected 2 (each "
            "woken claim runs a claim transaction; one that gets a job passes the wake-up on)"
        )
        assert limits[0] == 5, "the probe counts up to the number of claims waiting"
        for t in local:
            t.cancel()
        await waits.close()

    asyncio.run(scenario())
