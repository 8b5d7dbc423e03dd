"""Settings and client input the breaker found unfriendly: driverless PostgreSQL URLs, the
URL printed for an IPv6 wildcard bind, tokens with characters no token has."""

from __future__ import annotations

import pytest

from service.client import ApiTokenError, DdpqClient
from service.core.config import Settings
from service.store.db import Database


@pytest.mark.parametrize(
    ("given", "resolved"),
    [
        ("postgres://u:pw@db:5432/ddpq", "postgresql+psycopg://u:pw@db:5432/ddpq"),
        ("postgresql://u@db/ddpq", "postgresql+psycopg://u@db/ddpq"),
        ("postgresql+psycopg://u@db/ddpq", "postgresql+psycopg://u@db/ddpq"),
        ("sqlite:////tmp/x.db", "sqlite:////tmp/x.db"),
    ],
)
def test_driverless_postgres_urls_get_psycopg(given: str, resolved: str) -> None:
    url = Settings(database_url=given).resolved_database_url
    assert url == resolved
    Database.from_url(url).dispose()  # an engine builds (no connection is made)


@pytest.mark.parametrize(
    ("host", "url"),
    [("0.0.0.0", "http://127.0.0.1:8123"), ("::", "http://[::1]:8123"),
     ("10.1.2.3", "http://10.1.2.3:8123")],
)  # fmt: skip
def test_wildcard_binds_print_a_loopback_url_of_their_family(host: str, url: str) -> None:
    assert Settings(host=host, port=8123).resolved_api_url == url


@pytest.mark.parametrize("token", ["é", "ddpq_abc\ndef", "ddpq_a b", "ddpq_\x00x"])
def test_a_token_no_token_could_be_is_a_clear_error(token: str) -> None:
    with pytest.raises(ApiTokenError, match="ddpq token create"):
        DdpqClient("http://127.0.0.1:1", token=token)
    DdpqClient("http://127.0.0.1:1", token=" ddpq_ok-Token_1\n").close()  # trimmed, accepted
