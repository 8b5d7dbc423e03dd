"""The worker API's claim of several jobs at once and its remembered token check, over the
real app on SQLite and PostgreSQL: a worker with free slots takes up to that many jobs in one
request, each with its own attempt token; the token of a registered worker is looked up once
per ``REVOKED_TOKEN_GRACE_S``, yet a revoked token claims and renews nothing from its next
call and is refused everywhere once the grace has passed."""

from __future__ import annotations

import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.api import deps
from service.core.config import Settings
from service.core.errors import WorkerTokenRefusedError
from service.core.events import EventKind
from service.core.holds import ClaimedJob, Transition
from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.core.wire import attempt as attempt_wire
from service.core.wire import worker as wire
from service.store.auth import service as auth
from service.store.db import Database
from service.store.workers import service as workers
from tests.integration.test_worker_api import World, _headers
from worker.api_client import ApiRecords

API = API_PREFIX


@pytest.fixture(params=["auth_off", "auth_on"])
def app_settings(request: pytest.FixtureRequest, settings: Settings) -> Settings:
    return settings.model_copy(
        update={"auth": "on" if request.param == "auth_on" else "off", "lease_s": 60}
    )


@pytest.fixture
def world(api: TestClient, db: Database, app_settings: Settings) -> World:
    return World(api, db, app_settings)


def _revoke(world: World, name: str) -> None:
    auth.revoke_token(world.db, next(t.id for t in auth.list_tokens(world.db) if t.name == name))


def test_a_claim_with_a_limit_takes_up_to_that_many_jobs(world: World) -> None:
    submitted = [world.submit(name=f"j{i}") for i in range(3)]
    got = world.a.claim_many(0, 2)
    assert [j.job_id for j in got] == submitted[:2], "the oldest two, best first"
    tokens = [j.attempt_token for j in got]
    assert all(tokens) and len(set(tokens)) == 2, "an attempt token of its own per job"
    for job in got:  # each opens the attempt API for its own job only
        r = world.api.get(
            API + attempt_wire.SELF_PATH, headers={"Authorization": f"Bearer {job.attempt_token}"}
        )
        assert r.status_code == 200 and r.json()["job_id"] == job.job_id, r.text
    held = sorted(h.job_id for h in world.a.heartbeat())
    assert held == submitted[:2]
    rest = world.a.claim_many(0, 5)
    assert [j.job_id for j in rest] == submitted[2:], "what is left, not waiting for more"
    assert world.b.claim_many(0, 5, wait_s=0.2) == []


def test_who_may_claim_several_jobs(world: World) -> None:
    world.submit()
    rank = world.a.claim(0)
    assert rank is not None
    job_id = world.submit()
    body = {"max_gpus_per_node": 0, "limit": 3}

    def call(headers: dict[str, str]) -> int:
        return world.api.post(API + wire.CLAIM_PATH, json=body, headers=headers).status_code

    assert call({wire.WORKER_ID_HEADER: "w-a"}) == 401  # no token
    assert call(_headers(world.user)) == 401  # a user's token
    assert call(_headers(rank.attempt_token)) == 401  # a rank's token
    assert call(_headers(world.token_b, "w-a")) == 403  # another worker's token, A's id
    revoked = auth.create_worker_token(world.db, name="gone").token
    _revoke(world, "gone")
    assert call(_headers(revoked, "w-a")) == 401  # a revoked worker token
    assert world.job(job_id)["state"] == "queued", "none of them claimed it"
    assert call(_headers(world.token_a)) == 200
    assert world.job(job_id)["state"] == "starting"


def test_a_registered_workers_token_is_looked_up_once_per_grace(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    lookups: list[str] = []
    find = workers.find_worker_caller

    def counted(*args: Any) -> Any:
        lookups.append(args[2])
        return find(*args)

    monkeypatch.setattr(workers, "find_worker_caller", counted)
    for _ in range(3):
        world.a.heartbeat()
        world.b.heartbeat()
    assert sorted(lookups) == ["w-a", "w-b"], f"one lookup per worker, not {lookups}"
    # A caller still to register is looked up every time: its registration may come from
    # another API process.
    fresh = ApiRecords("", world.token_a, "w-new", "local", client=world.api)
    for _ in range(2):
        with pytest.raises(Exception, match="not registered"):
            fresh.heartbeat()
    assert lookups.count("w-new") == 2


def test_a_revoked_token_claims_and_renews_nothing_at_its_next_call(world: World) -> None:
    """Even with its token remembered by the API: the claim and the heartbeat check it in
    their own transaction."""
    held = world.submit()
    assert world.a.claim(0) is not None
    queued = world.submit()
    world.a.heartbeat()  # the token is remembered now
    _revoke(world, "gpu-a")
    with pytest.raises(WorkerTokenRefusedError):
        world.a.heartbeat()
    with pytest.raises(WorkerTokenRefusedError):
        world.a.claim_many(0, 3)
    assert world.job(queued)["state"] == "queued"
    assert world.job(held)["state"] == "starting"


def test_a_revoked_token_is_refused_everywhere_after_the_grace(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(deps, "REVOKED_TOKEN_GRACE_S", 0.5)
    job_id = world.submit()
    assert world.a.claim(0) is not None  # remembered for 0.5 s from here
    _revoke(world, "gpu-a")
    time.sleep(0.6)
    launched = Transition.of(job_id, JobState.STARTING, JobState.RUNNING, EventKind.LAUNCHED)
    with pytest.raises(WorkerTokenRefusedError):
        world.a.apply(launched)
    assert world.job(job_id)["state"] == "starting"


@pytest.mark.parametrize("gpus", [[], [0, 1]], ids=["no_gpus", "host_gpus"])
def test_a_worker_with_free_slots_claims_them_in_one_request(
    world: World, app_settings: Settings, monkeypatch: pytest.MonkeyPatch, gpus: list[int]
) -> None:
    """Three free slots, three queued jobs: one claim request takes them all and each is
    launched. A worker handing out free GPUs of its own claims one job per request: each
    job may ask for every free GPU."""
    from tests.integration.test_loop_worker import ScriptedLauncher
    from worker.loop import WorkerLoop

    submitted = [world.submit(name=f"j{i}") for i in range(3)]
    claims_sent: list[int] = []  # the limit of each claim request
    claim_many, claim = world.a.claim_many, world.a.claim

    def many(max_gpus: int, limit: int, wait_s: float = 0.0) -> list[ClaimedJob]:
        claims_sent.append(limit)
        return claim_many(max_gpus, limit, wait_s)

    def one(max_gpus: int, wait_s: float = 0.0) -> ClaimedJob | None:
        claims_sent.append(1)
        return claim(max_gpus, wait_s)

    monkeypatch.setattr(world.a, "claim_many", many)
    monkeypatch.setattr(world.a, "claim", one)
    launcher = ScriptedLauncher()
    loop = WorkerLoop(app_settings, world.a, launcher, host="h", pid=1, slots=3, gpus=gpus, cpus=2)
    loop.tick()
    assert sorted(loop.runs) == submitted and len(launcher.started) == 3
    want = [1, 1, 1] if gpus else [3]
    assert claims_sent == want, f"claims sent with these limits: {claims_sent}, not {want}"
    assert {world.job(j)["state"] for j in submitted} == {"running"}
