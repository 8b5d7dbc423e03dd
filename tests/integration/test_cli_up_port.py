"""`ddpq up` on a port that is taken: by a ddpq API already (the message gives its URL and
says to use it or stop it; nothing is minted or migrated first), or by another process (the
message says to choose another port)."""

from __future__ import annotations

import functools
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from typer.testing import CliRunner

from service.cli import main as cli_main
from service.core.config import local_url
from worker import up as worker_up
from worker.errors import PortInUseError


def _port(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None, url
    return port


def _up(tmp_path: Path, port: int, monkeypatch: pytest.MonkeyPatch) -> Any:
    """`ddpq up --port PORT`, with migrating/minting and the children made to fail loudly:
    a second `ddpq up` must stop before either."""

    def must_not_run(*_args: Any, **_kwargs: Any) -> str:
        raise AssertionError("ddpq up went past the port check (minted or started children)")

    monkeypatch.setattr(cli_main, "_prepare_up", must_not_run)
    monkeypatch.setattr(worker_up, "run_up", must_not_run)
    env = {"DDPQ_HOME": str(tmp_path / "second"), "COLUMNS": "300"}
    args = ["up", "--host", "127.0.0.1", "--port", str(port)]
    return CliRunner().invoke(cli_main.app, args, env=env)


def test_a_second_up_on_a_ddpq_port_says_ddpq_runs_there(
    live_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = _port(live_url)
    with pytest.raises(PortInUseError, match=f"ddpq already runs at {live_url} "):
        worker_up.check_port_free("127.0.0.1", port)
    result = _up(tmp_path, port, monkeypatch)
    assert result.exit_code == 2, result.output
    assert f"ddpq already runs at {live_url}" in result.output, result.output
    assert f"DDPQ_API_URL={live_url}" in result.output and "stop it first" in result.output
    assert "another port" not in result.output, "ddpq's own API is no foreign process"
    assert "auth off" not in result.output, "the refusal stands alone, no server's notes"


def test_a_port_held_by_another_server_says_choose_another_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as foreign:
        thread = threading.Thread(target=foreign.serve_forever, daemon=True)
        thread.start()
        try:
            port = foreign.server_address[1]
            with pytest.raises(PortInUseError, match=f"127.0.0.1:{port}.*another port"):
                worker_up.check_port_free("127.0.0.1", port)
            result = _up(tmp_path, port, monkeypatch)
        finally:
            foreign.shutdown()
            thread.join(10)
    assert result.exit_code == 2, result.output
    assert "choose another port" in result.output and "ddpq already runs" not in result.output


def test_the_probed_url_of_a_bind_address() -> None:
    assert local_url("0.0.0.0", 8000) == "http://127.0.0.1:8000"
    assert local_url("::", 8000) == "http://[::1]:8000"
    assert local_url("10.1.2.3", 8011) == "http://10.1.2.3:8011"
