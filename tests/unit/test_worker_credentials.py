"""What a worker starts with (worker.main.worker_credentials): the API's root URL and a worker
token; a database URL, a user's token, or an API URL it could never reach are refused at
start with the fix in the message."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr

from service.core.config import Settings
from worker.errors import WorkerConfigError
from worker.main import worker_credentials

TOKEN = "ddpqw_" + "a" * 43


def _settings(tmp_path: Path, **kw: object) -> Settings:
    return Settings(home=tmp_path, worker_token=SecretStr(TOKEN), **kw)  # type: ignore[arg-type]


def test_the_api_root_and_the_token(tmp_path: Path) -> None:
    assert worker_credentials(_settings(tmp_path)) == ("http://127.0.0.1:8000", TOKEN)
    printed = _settings(tmp_path, api_url="http://api-host:8000/api/v1")  # what `ddpq up` prints
    assert worker_credentials(printed) == ("http://api-host:8000", TOKEN)


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"database_url": "postgresql+psycopg://u:p@db/ddpq"}, "DDPQ_DATABASE_URL is set"),
        ({"worker_token": SecretStr("ddpq_" + "a" * 43)}, "not a worker token"),
        ({"worker_token": None}, "no worker token"),
        ({"api_url": "127.0.0.1:8000"}, "not an http(s) URL"),
        ({"api_url": "http://api-host:8000/dashboard"}, "has a path"),
    ],
)
def test_what_a_worker_refuses_at_start(tmp_path: Path, kw: dict[str, object], says: str) -> None:
    settings = _settings(tmp_path).model_copy(update=kw)
    with pytest.raises(WorkerConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        worker_credentials(settings)
