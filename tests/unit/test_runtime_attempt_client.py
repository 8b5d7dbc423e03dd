"""The rank's attempt API client: the one error table (what is retryable, what is the fence,
what is refused), Retry-After, the bearer token and the wire paths; no answer at all (a
refused connection, a timeout) is retryable. Answers are played with httpx's MockTransport
(the HTTP boundary); the real API is exercised by the sink, checkpoint and e2e tests."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from service.core.errors import DdpqError, StaleAttemptError
from service.core.wire import API_PREFIX
from service.core.wire import attempt as wire
from worker.runtime.attempt_client import (
    MAX_RETRY_AFTER_S,
    ApiUnavailableError,
    AttemptClient,
    AttemptRequestError,
)


def client_answering(status: int, headers: dict[str, str] | None = None) -> AttemptClient:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, headers=headers, json={"detail": f"status {status}"})

    return AttemptClient("http://api.test", "ddpqa_t", transport=httpx.MockTransport(answer))


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (500, ApiUnavailableError),
        (502, ApiUnavailableError),
        (503, ApiUnavailableError),
        (429, ApiUnavailableError),
        (409, StaleAttemptError),
        (401, StaleAttemptError),
        (422, AttemptRequestError),
        (404, AttemptRequestError),
    ],
)
def test_every_error_answer_maps_onto_one_rank_error(status: int, error: type[DdpqError]) -> None:
    with client_answering(status) as client, pytest.raises(error, match=f"{status} status"):
        client.self_check()


def test_retry_after_is_carried_in_seconds_and_capped() -> None:
    for raw, expected in (("3", 3.0), ("0.5", 0.5), ("99999", MAX_RETRY_AFTER_S), ("soon", None)):
        with client_answering(429, {"Retry-After": raw}) as client:
            with pytest.raises(ApiUnavailableError) as caught:
                client.send_metrics(wire.MetricBatch())
            assert caught.value.retry_after_s == expected, raw
    with client_answering(503) as client, pytest.raises(ApiUnavailableError) as caught:
        client.list_checkpoints()
    assert caught.value.retry_after_s is None


def test_requests_carry_the_token_on_the_wire_paths() -> None:
    seen: list[tuple[str, str, str]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path, request.headers["Authorization"]))
        if request.url.path.endswith(wire.SELF_PATH):
            return httpx.Response(200, json={"job_id": 4, "attempt": 2, "state": "running"})
        if request.url.path.endswith(wire.METRICS_PATH):
            return httpx.Response(200, json={"accepted": 1, "inserted": 1})
        if request.method == "GET":
            return httpx.Response(200, json={"checkpoints": []})
        return httpx.Response(204 if "/checkpoints/" in request.url.path else 201, json={})

    transport = httpx.MockTransport(answer)
    # A trailing /api/v1 on the URL is accepted as well as the bare base URL.
    with AttemptClient(
        f"http://api.test{API_PREFIX}/", " ddpqa_t\n", transport=transport
    ) as client:
        me = client.self_check()
        ack = client.send_metrics(wire.MetricBatch(points=[("loss", 1, 0, 0.5, 1.0)]))
        assert client.list_checkpoints() == []
        client.record_checkpoint(
            wire.CheckpointRecord(step=1, epoch=0, path="p", size_bytes=1, sha256="0" * 64)
        )
        client.record_checkpoint_failure(wire.CheckpointFailure(step=2, reason="disk full"))
        client.record_deletions([1])
        client.record_deletions([])  # nothing to say: no request
    assert (me.job_id, me.attempt, ack.inserted) == (4, 2, 1)
    prefix = API_PREFIX
    assert seen == [
        ("GET", prefix + wire.SELF_PATH, "Bearer ddpqa_t"),
        ("POST", prefix + wire.METRICS_PATH, "Bearer ddpqa_t"),
        ("GET", prefix + wire.CHECKPOINTS_PATH, "Bearer ddpqa_t"),
        ("POST", prefix + wire.CHECKPOINTS_PATH, "Bearer ddpqa_t"),
        ("POST", prefix + wire.CHECKPOINT_FAILURES_PATH, "Bearer ddpqa_t"),
        ("POST", prefix + wire.CHECKPOINT_DELETIONS_PATH, "Bearer ddpqa_t"),
    ]


def test_an_unreadable_answer_is_retryable() -> None:
    """A proxy's HTML page with 200, or an API of another version: not a crash, a retry."""

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text="<html>proxy</html>")

    client = AttemptClient("http://api.test", "ddpqa_t", transport=httpx.MockTransport(answer))
    with client, pytest.raises(ApiUnavailableError, match="does not parse as AttemptSelf"):
        client.self_check()


def test_a_refused_connection_is_retryable() -> None:
    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = AttemptClient(f"http://127.0.0.1:{port}", "ddpqa_t")
    with client, pytest.raises(ApiUnavailableError, match="cannot reach the attempt API"):
        client.self_check()


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield int(server.getsockname()[1])
    stop.set()
    thread.join(5)
    for conn in held:
        conn.close()
    server.close()


def test_a_timeout_is_retryable(silent_server: int) -> None:
    url = f"http://127.0.0.1:{silent_server}"
    client = AttemptClient(url, "ddpqa_t", read_timeout_s=0.3)
    with client, pytest.raises(ApiUnavailableError, match="timed out"):
        client.send_metrics(wire.MetricBatch())
