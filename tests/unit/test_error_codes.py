"""Clients branch on an error's stable ``code``, never on its wording: the client keeps the
server's code on ``ApiError``, and the CLI's advice follows the code alone."""

from __future__ import annotations

import httpx
import pytest
import typer

from service.cli.common import friendly_errors
from service.client import ApiError, DdpqClient
from service.core.errors import JobNotFoundError, NotFoundError, SweepNotFoundError


def client_answering(status: int, body: object) -> DdpqClient:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json=body)

    return DdpqClient("http://api.test", transport=httpx.MockTransport(answer))


def test_not_found_errors_name_their_resource_in_the_code() -> None:
    assert JobNotFoundError(7).code == "job_not_found" and str(JobNotFoundError(7)) == (
        "job 7 not found"
    )
    assert SweepNotFoundError(3).code == "sweep_not_found"
    assert isinstance(JobNotFoundError(7), NotFoundError), "still a 404 to every handler"
    assert JobNotFoundError.status_code == SweepNotFoundError.status_code == 404


def test_the_client_keeps_the_servers_code() -> None:
    answer = {"detail": "whatever it says", "code": "job_not_found"}
    with client_answering(404, answer) as c, pytest.raises(ApiError) as caught:
        c.get_job(5)
    assert caught.value.code == JobNotFoundError.code
    assert caught.value.detail == "whatever it says" and caught.value.status_code == 404


@pytest.mark.parametrize("body", [{"detail": "job 5 not found"}, ["not", "a", "dict"]])
def test_an_answer_without_a_code_keeps_the_clients_own(body: object) -> None:
    with client_answering(404, body) as c, pytest.raises(ApiError) as caught:
        c.get_job(5)
    assert caught.value.code == ApiError.code


def advice(exc: ApiError, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(typer.Exit), friendly_errors():
        raise exc
    return capsys.readouterr().err


def test_the_cli_advises_by_code_not_by_wording(capsys: pytest.CaptureFixture[str]) -> None:
    reworded = advice(ApiError(404, "no such thing as 5", code="job_not_found"), capsys)
    assert "`ddpq ls`" in reworded, reworded
    sweep = advice(ApiError(404, "gone", code="sweep_not_found"), capsys)
    assert "`ddpq sweep ls`" in sweep, sweep
    # The old wording without the code (a proxy, another service) gets no advice.
    assert "fix:" not in advice(ApiError(404, "job 5 not found"), capsys)
