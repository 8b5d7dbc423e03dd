"""The worker API over the real app, on SQLite and PostgreSQL: a worker token registers its
worker, claims jobs with their specs and attempt tokens (a long poll), renews its leases,
moves only the jobs its worker holds; nobody else's token opens a worker route, and a worker
token opens nothing else. Driven through the worker's own client (``ApiRecords``)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.core.config import Settings
from service.core.errors import (
    NotFoundError,
    StaleStateError,
    WorkerTokenMismatchError,
    WorkerTokenRefusedError,
)
from service.core.events import EventKind
from service.core.holds import SchedulerHandle, Transition
from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.core.wire import attempt as attempt_wire
from service.core.wire import worker as wire
from service.store.auth import service as auth
from service.store.db import Database
from service.store.jobs import claims
from service.store.workers import registry as workers_registry
from tests.live import serve_app
from worker.api_client import ApiRecords

API = API_PREFIX
SPEC: dict[str, Any] = {"name": "reg", "task": "regression", "training": {"max_steps": 10}}
CAPACITY = {"slots": 2, "gpus": [], "cpus": 2}
# Every worker route with a well-formed body (job ids filled in by _body).
ROUTES: list[tuple[str, str, Any]] = [
    ("PUT", wire.REGISTER_PATH, {"host": "h", "pid": 1, "launcher": "local", "capacity": {}}),
    ("POST", wire.HEARTBEAT_PATH, None),
    ("POST", wire.CLAIM_PATH, {"max_gpus_per_node": 0}),
    ("POST", wire.TRANSITIONS_PATH, "transition"),
    ("POST", wire.HANDLES_PATH, "handles"),
    ("POST", wire.NOTES_PATH, "note"),
    ("POST", wire.PENDING_PATH, "pending"),
    ("POST", wire.ADOPTIONS_PATH, None),
    ("POST", wire.ADOPTER_PATH, "adopter"),
    ("POST", wire.STOP_PATH, None),
]


@pytest.fixture(params=["auth_off", "auth_on"])
def app_settings(request: pytest.FixtureRequest, settings: Settings) -> Settings:
    return settings.model_copy(
        update={"auth": "on" if request.param == "auth_on" else "off", "lease_s": 60}
    )


def _body(route: tuple[str, str, Any], job_id: int) -> Any:
    _, _, body = route
    if body == "transition":
        t = Transition.of(job_id, JobState.STARTING, JobState.RUNNING, EventKind.LAUNCHED)
        return {"transition": {"job_id": t.job_id, "expected": "starting", "target": "running",
                               "reason": t.reason, "kind": "launched", "data": {}}}  # fmt: skip
    if body == "handles":
        return {"handles": [{"job_id": job_id, "attempt": 1, "scheduler_job_id": "77"}]}
    if body == "note":
        return {"job_id": job_id, "attempt": 1, "kind": "more_ranks_than_cores",
                "data": {"nproc_per_node": 4, "cpus": 2}}  # fmt: skip
    if body == "pending":
        return {"job_id": job_id, "attempt": 1, "code": "Priority", "words": "waits"}
    if body == "adopter":
        return {"job_id": job_id, "attempt": 1}
    return body


def _headers(token: str, worker_id: str = "w-a") -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", wire.WORKER_ID_HEADER: worker_id}


class World:
    """The app, a user token (auth on), worker tokens A and B, and a job worker A holds."""

    def __init__(self, api: TestClient, db: Database, settings: Settings) -> None:
        self.api, self.db = api, db
        self.user = auth.create_token(db, owner="alice").token
        self.user_headers = {"Authorization": f"Bearer {self.user}"}
        self.token_a = auth.create_worker_token(db, name="gpu-a").token
        self.token_b = auth.create_worker_token(db, name="gpu-b").token
        self.a = ApiRecords("", self.token_a, "w-a", "local", client=api)
        self.b = ApiRecords("", self.token_b, "w-b", "local", client=api)
        self.a.register(host="host-a", pid=11, capacity=CAPACITY)
        self.b.register(host="host-b", pid=12, capacity=CAPACITY)

    def submit(self, **extra: Any) -> int:
        r = self.api.post(f"{API}/jobs", json={**SPEC, **extra}, headers=self.user_headers)
        assert r.status_code == 201, r.text
        return int(r.json()["id"])

    def job(self, job_id: int) -> dict[str, Any]:
        r = self.api.get(f"{API}/jobs/{job_id}", headers=self.user_headers)
        assert r.status_code == 200, r.text
        return dict(r.json())


@pytest.fixture
def world(api: TestClient, db: Database, app_settings: Settings) -> World:
    return World(api, db, app_settings)


def test_a_worker_claims_runs_and_finishes_a_job_over_the_api(world: World) -> None:
    job_id = world.submit()
    claimed = world.a.claim(0)
    assert claimed is not None and claimed.job_id == job_id and claimed.attempt == 1
    assert claimed.spec["name"] == "reg"
    # And its owner: whose Unix user a root-run local worker starts the ranks as.
    assert claimed.owner == world.job(job_id)["owner"] and claimed.owner
    # The claim brought the ranks' token: it opens the attempt API for that attempt.
    r = world.api.get(
        API + attempt_wire.SELF_PATH, headers={"Authorization": f"Bearer {claimed.attempt_token}"}
    )
    assert r.status_code == 200 and r.json()["job_id"] == job_id, r.text
    held = world.a.heartbeat()
    assert [(h.job_id, h.attempt, h.state) for h in held] == [(job_id, 1, "starting")]
    assert world.b.heartbeat() == []
    launched = Transition.of(job_id, JobState.STARTING, JobState.RUNNING, EventKind.LAUNCHED)
    assert world.a.apply(launched) == JobState.RUNNING
    assert world.a.note(
        job_id, 1, EventKind.MORE_RANKS_THAN_CORES, {"nproc_per_node": 4, "cpus": 2}
    )
    assert world.a.note_pending_reason(job_id, 1, "Priority", "waits for priority")
    world.a.record_handles([SchedulerHandle(job_id, 1, "4242")])
    done = Transition.of(job_id, JobState.RUNNING, JobState.SUCCEEDED, EventKind.SUCCEEDED)
    assert world.a.apply(done) == JobState.SUCCEEDED
    job = world.job(job_id)
    assert job["state"] == "succeeded" and job["worker_id"] == "w-a"
    assert job["scheduler_job_id"] == "4242"
    assert world.a.heartbeat() == []


def test_a_cancel_reaches_the_worker_on_its_heartbeat(world: World) -> None:
    job_id = world.submit()
    assert world.a.claim(0) is not None
    r = world.api.post(f"{API}/jobs/{job_id}/cancel", headers=world.user_headers)
    assert r.status_code == 202, r.text
    assert [h.cancel_requested for h in world.a.heartbeat()] == [True]


def test_a_waiting_claim_is_answered_when_a_job_is_submitted(world: World) -> None:
    got: list[Any] = []
    claim = threading.Thread(target=lambda: got.append(world.a.claim(0, wait_s=25.0)))
    start = time.monotonic()
    claim.start()
    time.sleep(0.5)  # the claim is waiting now
    job_id = world.submit()
    claim.join(30)
    assert got and got[0] is not None and got[0].job_id == job_id
    # It was woken by the submission, not by the end of its 25 s wait.
    assert time.monotonic() - start < 20
    # With nothing queued a claim waits its time and comes back empty.
    assert world.b.claim(0, wait_s=0.3) is None


def test_a_claim_whose_worker_hung_up_takes_no_job(world: World, app_settings: Settings) -> None:
    """A worker that hangs up during its long poll (killed, or its client gave up) gets no job
    claimed in its name when the wait ends: it would never learn of it, and the job would sit
    starting until its lease ran out. Over real HTTP: only a socket can hang up."""
    with serve_app(create_app(app_settings)) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        body = b'{"max_gpus_per_node": 0, "wait_s": 10}'
        head = "".join(f"{k}: {v}\r\n" for k, v in _headers(world.token_a).items())
        request = (
            f"POST {API}{wire.CLAIM_PATH} HTTP/1.1\r\nHost: {host}\r\n{head}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(request + body)
            time.sleep(0.5)  # the claim waits now (or ends at once if it sees the hang-up)
        time.sleep(0.2)  # the server reads the hang-up
        r = httpx.post(f"{url}{API}/jobs", json=SPEC, headers=world.user_headers, timeout=30)
        assert r.status_code == 201, r.text
        job_id = int(r.json()["id"])
        time.sleep(0.5)  # a woken claim of worker A would have taken the job by now
        job = world.job(job_id)
    assert job["state"] == "queued", (
        f"job {job_id} is {job['state']} for {job['worker_id']}: the hung-up claim took it "
        "(the claim route must check for a disconnect after its wait, before claiming)"
    )
    claimed = world.b.claim(0)
    assert claimed is not None and claimed.job_id == job_id


def test_a_worker_moves_only_the_jobs_it_holds(world: World) -> None:
    job_id = world.submit()
    assert world.a.claim(0) is not None
    launched = Transition.of(job_id, JobState.STARTING, JobState.RUNNING, EventKind.LAUNCHED)
    with pytest.raises(StaleStateError):
        world.b.apply(launched)  # B does not hold it
    assert (
        world.b.note(job_id, 1, EventKind.MORE_RANKS_THAN_CORES, {"nproc_per_node": 4, "cpus": 2})
        is False
    )
    world.b.record_handles([SchedulerHandle(job_id, 1, "666")])
    job = world.job(job_id)
    assert job["state"] == "starting" and job["scheduler_job_id"] is None
    events = world.api.get(f"{API}/jobs/{job_id}/events", headers=world.user_headers).json()
    assert not [e for e in events["events"] if e.get("kind") == "more_ranks_than_cores"]


def test_a_transition_writes_no_column_but_restarts(world: World) -> None:
    job_id = world.submit()
    assert world.a.claim(0) is not None
    body = _body(("POST", wire.TRANSITIONS_PATH, "transition"), job_id)
    body["values"] = {"owner": "mallory"}
    r = world.api.post(API + wire.TRANSITIONS_PATH, json=body, headers=_headers(world.token_a))
    assert r.status_code == 422, r.text
    assert world.job(job_id)["state"] == "starting"


@pytest.mark.parametrize("route", ROUTES, ids=[r[1] for r in ROUTES])
def test_who_may_call_each_worker_route(world: World, route: tuple[str, str, Any]) -> None:
    job_id = world.submit()
    assert world.a.claim(0) is not None
    method, path = route[0], API + route[1]
    body = _body(route, job_id)
    attempt = world.a.claim(0)  # nothing more: the attempt token comes from a fresh job
    assert attempt is None
    other = world.submit(name="other")
    rank_token = world.b.claim(0)
    assert rank_token is not None and rank_token.job_id == other

    def call(headers: dict[str, str]) -> int:
        return world.api.request(method, path, json=body, headers=headers).status_code

    assert call({wire.WORKER_ID_HEADER: "w-a"}) == 401  # no token
    assert call(_headers(world.user)) == 401  # a user's token
    assert call(_headers(rank_token.attempt_token)) == 401  # a rank's token
    assert call(_headers(world.token_b, "w-a")) == 403  # another worker's token, A's id
    revoked = auth.create_worker_token(world.db, name="gone").token
    auth.revoke_token(world.db, auth.list_tokens(world.db)[-1].id)
    assert call(_headers(revoked, "w-a")) == 401  # a revoked worker token
    assert (
        world.api.request(method, path, json=body, headers=_headers(world.token_a)).status_code
        < 400
    )


def test_a_worker_token_opens_no_user_or_attempt_route(world: World) -> None:
    headers = {"Authorization": f"Bearer {world.token_a}"}
    user_and_rank_routes = [
        ("GET", "/jobs"),
        ("GET", "/workers"),
        ("POST", "/jobs"),
        ("GET", attempt_wire.SELF_PATH),
        ("POST", attempt_wire.METRICS_PATH),
    ]
    for method, path in user_and_rank_routes:
        r = world.api.request(method, API + path, json=SPEC, headers=headers)
        assert r.status_code == 401, (method, path, r.text)


def test_a_revoked_token_stops_its_worker_claiming(world: World) -> None:
    world.submit()
    token_id = next(t.id for t in auth.list_tokens(world.db) if t.name == "gpu-a")
    auth.revoke_token(world.db, token_id)
    with pytest.raises(WorkerTokenRefusedError):
        world.a.claim(0)
    with pytest.raises(WorkerTokenRefusedError):
        world.a.heartbeat()
    assert world.b.claim(0) is not None  # the job is still there for another worker


def test_a_worker_id_stays_with_the_token_that_registered_it(world: World) -> None:
    thief = ApiRecords("", world.token_b, "w-a", "local", client=world.api)
    with pytest.raises(WorkerTokenMismatchError):
        thief.register(host="x", pid=1, capacity=CAPACITY)
    with pytest.raises(WorkerTokenMismatchError):
        thief.heartbeat()
    fresh = ApiRecords("", world.token_b, "w-new", "local", client=world.api)
    with pytest.raises(NotFoundError):
        fresh.heartbeat()  # not registered yet: the loop registers again on this


def test_the_worker_list_tells_live_from_lost(
    api: TestClient, db: Database, app_settings: Settings
) -> None:
    world = World(api, db, app_settings)
    with db.session() as s:  # worker B last beat long ago
        from sqlalchemy import text

        s.execute(text("UPDATE workers SET heartbeat_at = '2020-01-01 00:00:00' WHERE id = 'w-b'"))
    listed = api.get(f"{API}/workers", headers=world.user_headers).json()["workers"]
    status = {w["id"]: w["status"] for w in listed}
    assert status == {"w-a": "live", "w-b": "lost"}
    world.a.stop()
    listed = api.get(f"{API}/workers", headers=world.user_headers).json()["workers"]
    assert {w["id"]: w["status"] for w in listed}["w-a"] == "stopped"


def test_an_api_app_serves_the_worker_routes_in_its_docs(settings: Settings, db: Database) -> None:
    with TestClient(create_app(settings)) as api:
        paths = api.get("/openapi.json").json()["paths"]
    assert {API + wire.CLAIM_PATH, API + wire.REGISTER_PATH} <= set(paths)


def test_a_worker_with_a_refused_token_stops_at_start_saying_why(
    settings: Settings, db: Database
) -> None:
    from tests.live import serve_app
    from tests.workers import worker_settings
    from worker.errors import WorkerConfigError
    from worker.main import run_worker

    revoked = auth.create_worker_token(db, name="old").token
    auth.revoke_token(db, auth.list_tokens(db)[-1].id)
    with serve_app(create_app(settings)) as url:
        for token in ("ddpqw_" + "x" * 43, revoked):
            bad = worker_settings(settings.model_copy(update={"api_url": url}), token)
            with pytest.raises(WorkerConfigError, match="DDPQ_WORKER_TOKEN"):
                run_worker(bad, gpus=[], stop=threading.Event())
        listed = TestClient(create_app(settings)).get(f"{API}/workers").json()["workers"]
    assert listed == [], "nothing registered with a refused token"


# -- hostile bodies: 422, nothing written ------------------------------------------------------

# Event data its kind's wording could not word (a text where it multiplies a number, a number
# where it lists steps, a list where the reason column takes a text, a field it lacks, one it
# does not name): each was a 500 (or a misleading 503) while the event row was written.
BAD_NOTES: list[tuple[str, dict[str, Any]]] = [
    ("more_ranks_than_cores", {"nproc_per_node": 10_000, "cpus": 1, "batch_size": "x" * 1000}),
    ("more_ranks_than_cores", {"nproc_per_node": "x", "cpus": 1, "batch_size": "y"}),
    ("fresh_start", {"attempt": 1, "damaged_steps": 5}),
    ("fresh_start", {"attempt": 1}),
    ("note", {"text": {"a": 1}}),
    ("note", {"text": [1, 2]}),
    ("note", {"text": "t", "extra": "x" * 100_000}),
    ("checkpoint_damaged", {"step": "abc"}),
    ("more_ranks_than_cores", {"nproc_per_node": 2**70, "cpus": 1}),
]
BAD_TRANSITION_EVENTS: list[tuple[str, dict[str, Any]]] = [
    ("retried", {}),
    ("more_ranks_than_cores", {"nproc_per_node": "x", "cpus": 1, "batch_size": "y"}),
    ("failed", {"error": ["not", "a", "text"]}),
]


def _event_kinds(world: World, job_id: int) -> list[str]:
    r = world.api.get(f"{API}/jobs/{job_id}/events", headers=world.user_headers)
    assert r.status_code == 200, r.text
    return [e["kind"] for e in r.json()["events"]]


@pytest.mark.parametrize(
    ("kind", "data"), BAD_NOTES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(BAD_NOTES)]
)
def test_a_note_its_kind_cannot_word_is_422_and_writes_nothing(
    world: World, kind: str, data: dict[str, Any]
) -> None:
    job_id = world.submit()
    assert world.a.claim(0) is not None
    before = _event_kinds(world, job_id)
    body = {"job_id": job_id, "attempt": 1, "kind": kind, "data": data}
    r = world.api.post(API + wire.NOTES_PATH, json=body, headers=_headers(world.token_a))
    assert r.status_code == 422 and r.json()["code"] == "invalid_request", r.text
    assert _event_kinds(world, job_id) == before


@pytest.mark.parametrize(
    ("kind", "data"),
    BAD_TRANSITION_EVENTS,
    ids=[f"{k}-{i}" for i, (k, _) in enumerate(BAD_TRANSITION_EVENTS)],
)
def test_a_transition_whose_event_cannot_be_worded_is_422_and_moves_nothing(
    world: World, kind: str, data: dict[str, Any]
) -> None:
    job_id = world.submit()
    assert world.a.claim(0) is not None
    body = {"transition": {"job_id": job_id, "expected": "starting", "target": "running",
                           "kind": kind, "data": data}}  # fmt: skip
    r = world.api.post(API + wire.TRANSITIONS_PATH, json=body, headers=_headers(world.token_a))
    assert r.status_code == 422 and r.json()["code"] == "invalid_request", r.text
    assert world.job(job_id)["state"] == "starting"
    assert _event_kinds(world, job_id) == ["submitted", "claimed"]


@pytest.mark.parametrize(
    "capacity",
    [
        {"slots": 0},
        {"slots": "many"},
        {"gpus": [-1]},
        {"gpus": list(range(2000))},
        {"cpus": 2**70},
        {"slots": 1, "disk": "x" * 100_000},
    ],
)
def test_a_capacity_the_api_cannot_use_is_422_and_the_registration_stands(
    world: World, capacity: dict[str, Any]
) -> None:
    body = {"host": "h", "pid": 1, "launcher": "local", "capacity": capacity}
    r = world.api.put(API + wire.REGISTER_PATH, json=body, headers=_headers(world.token_a))
    assert r.status_code == 422 and r.json()["code"] == "invalid_request", r.text
    listed = world.api.get(f"{API}/workers", headers=world.user_headers).json()["workers"]
    mine = next(w for w in listed if w["id"] == "w-a")
    assert mine["host"] == "host-a" and mine["capacity"]["slots"] == CAPACITY["slots"]


def test_ids_and_handles_the_database_cannot_hold_are_422(world: World) -> None:
    job_id = world.submit()
    assert world.a.claim(0) is not None
    huge = 2**70
    bodies = [
        (wire.TRANSITIONS_PATH,
         {"transition": {"job_id": huge, "expected": "starting", "target": "running"}}),
        (wire.HANDLES_PATH,
         {"handles": [{"job_id": huge, "attempt": 1, "scheduler_job_id": "1"}]}),
        (wire.HANDLES_PATH,
         {"handles": [{"job_id": job_id, "attempt": 2**40, "scheduler_job_id": "1"}]}),
        (wire.HANDLES_PATH,
         {"handles": [{"job_id": job_id, "attempt": 1, "scheduler_job_id": "9" * 65}]}),
        (wire.HANDLES_PATH,
         {"handles": [{"job_id": job_id, "attempt": 1, "scheduler_job_id": ""}]}),
    ]  # fmt: skip
    for path, body in bodies:
        r = world.api.post(API + path, json=body, headers=_headers(world.token_a))
        assert r.status_code == 422 and r.json()["code"] == "invalid_request", (path, r.text)
    job = world.job(job_id)
    assert job["state"] == "starting" and job["scheduler_job_id"] is None


def test_a_handle_of_a_job_that_ended_is_dropped(world: World) -> None:
    job_id = world.submit()
    assert world.a.claim(0) is not None
    failed = Transition.of(
        job_id, JobState.STARTING, JobState.FAILED, EventKind.FAILED, {"error": "boom"}
    )
    assert world.a.apply(failed) == JobState.FAILED
    world.a.record_handles([SchedulerHandle(job_id, 1, "4242")])
    assert world.job(job_id)["scheduler_job_id"] is None


# -- long polls ---------------------------------------------------------------------------------


def test_a_claim_waiting_when_its_token_is_revoked_claims_nothing(world: World) -> None:
    got: list[Any] = []

    def claim() -> None:
        try:
            got.append(world.a.claim(0, wait_s=20.0))
        except Exception as exc:  # what the claim answered, checked below
            got.append(exc)

    waiting = threading.Thread(target=claim)
    waiting.start()
    time.sleep(0.5)  # the claim waits now; its request's token check is behind it
    token_id = next(t.id for t in auth.list_tokens(world.db) if t.name == "gpu-a")
    auth.revoke_token(world.db, token_id)
    job_id = world.submit()  # wakes the waiting claim
    waiting.join(30)
    assert got and isinstance(got[0], WorkerTokenRefusedError), got
    assert world.job(job_id)["state"] == "queued"
    claimed = world.b.claim(0)
    assert claimed is not None and claimed.job_id == job_id


def test_a_claim_whose_worker_went_away_claims_nothing(
    db: Database, app_settings: Settings
) -> None:
    """Over a real server (a TestClient cannot hang up): a worker that gave up on its long
    poll (its timeout, a crash) gets no job claimed for it afterwards."""
    import httpx

    from tests.live import serve_app

    token = auth.create_worker_token(db, name="gpu-a").token
    user = auth.create_token(db, owner="alice").token
    with serve_app(create_app(app_settings)) as url:
        gone = ApiRecords(url, token, "w-gone", "local")
        gone.register(host="h", pid=1, capacity=CAPACITY)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                url + API + wire.CLAIM_PATH,
                json={"max_gpus_per_node": 0, "wait_s": 20},
                headers=_headers(token, "w-gone"),
                timeout=httpx.Timeout(1.0),
            )
        time.sleep(0.3)  # the server has seen the hang-up
        r = httpx.post(f"{url}{API}/jobs", json=SPEC, headers={"Authorization": f"Bearer {user}"})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        time.sleep(1.0)  # the waiting claim woke and, its client gone, answered nothing
        job = httpx.get(f"{url}{API}/jobs/{job_id}", headers={"Authorization": f"Bearer {user}"})
        assert job.json()["state"] == "queued", job.text
        assert gone.heartbeat() == []
        gone.close()


# -- a refused token ends the worker ------------------------------------------------------------


def test_a_worker_whose_token_is_revoked_stops_its_ranks_at_once_and_ends(
    world: World, app_settings: Settings
) -> None:
    """A revoked token never works again: the worker's loop stops its ranks at once (not
    when the lease fence would, ~25 s later) and ends with the error, instead of logging a
    traceback per retry forever while a supervisor (`ddpq up`, systemd) sees it alive."""
    from tests.integration.test_loop_worker import ScriptedLauncher
    from worker.loop import WorkerLoop

    launcher = ScriptedLauncher()
    loop = WorkerLoop(app_settings, world.a, launcher, host="host-a", pid=11, cpus=2)
    job_id = world.submit()
    loop.tick()
    assert world.job(job_id)["state"] == "running" and set(loop.runs) == {job_id}
    token_id = next(t.id for t in auth.list_tokens(world.db) if t.name == "gpu-a")
    auth.revoke_token(world.db, token_id)
    ended: list[BaseException] = []

    def run() -> None:
        try:
            loop.run(threading.Event())
        except BaseException as exc:  # what ended the loop, checked below
            ended.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the loop goes on with a revoked token"
    assert ended and isinstance(ended[0], WorkerTokenRefusedError), ended
    assert launcher.cancelled == [f"{job_id}.1"] and loop.runs == {}
    # Its lease (60 s) has not lapsed: the API's reaper requeues the job then.
    assert world.job(job_id)["state"] == "running"


def test_python_m_worker_main_says_why_a_refused_token_ends_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import worker.main

    def refused(*_: Any, **__: Any) -> None:
        raise WorkerTokenRefusedError("the API refused this worker's token (revoked)")

    monkeypatch.setattr(worker.main, "run_worker", refused)
    with pytest.raises(SystemExit) as exited:
        worker.main.main(["--gpus", "none"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "refused this worker's token" in err and "Traceback" not in err


def test_a_worker_row_from_before_worker_tokens_is_not_taken_over(world: World) -> None:
    """A row registered without a token (a worker on the database, before worker tokens)
    keeps the jobs it holds: a worker token that names its id (the adopters route tells any
    worker who holds a job) gets 403 and can neither renew nor move them."""
    job_id = world.submit()
    with world.db.session() as s:
        workers_registry.register_worker(
            s, worker_id="old-host-1-abc123", host="old", pid=1, launcher="local", capacity={}
        )
    with world.db.session() as s:
        claimed = claims.claim_next_job(
            s, worker_id="old-host-1-abc123", launcher="local", max_gpus_per_node=0, lease_s=60
        )
        assert claimed is not None and claimed.id == job_id
    thief = ApiRecords("", world.token_b, "old-host-1-abc123", "local", client=world.api)
    with pytest.raises(WorkerTokenMismatchError):
        thief.register(host="x", pid=1, capacity=CAPACITY)
    with pytest.raises(WorkerTokenMismatchError):
        thief.heartbeat()
    failed = Transition.of(
        job_id, JobState.STARTING, JobState.FAILED, EventKind.FAILED, {"error": "sabotage"}
    )
    with pytest.raises(WorkerTokenMismatchError):
        thief.apply(failed)
    assert world.job(job_id)["state"] == "starting"
