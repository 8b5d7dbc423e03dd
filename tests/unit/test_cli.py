"""The `ddpq` CLI without a server: parsing, formatting, and friendly failures (exit 2)."""

from __future__ import annotations

import re
import socket
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from service.cli import main as cli_main
from service.cli.main import app, parse_gpus
from service.cli.output import field_error_lines, format_bytes, format_metric, format_seconds

runner = CliRunner()


def closed_port_url() -> str:
    """A loopback URL nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def invoke(args: list[str], env: dict[str, str] | None = None) -> Any:
    return runner.invoke(app, args, env={"COLUMNS": "200", **(env or {})})


def test_parse_gpus() -> None:
    assert parse_gpus(None) is None
    assert parse_gpus("none") == [] and parse_gpus("NONE") == []
    assert parse_gpus("0,1") == [0, 1] and parse_gpus("3") == [3]
    for bad in ("a,b", "0,0", "-1", ","):
        with pytest.raises(typer.BadParameter):
            parse_gpus(bad)


def test_field_error_lines_strip_the_location_source() -> None:
    detail = [
        {"loc": ["body", "resources", "nproc_per_node"], "msg": "must be ≥ 1", "type": "x"},
        {"loc": ["query", "state"], "msg": "bad state", "type": "x"},
        {"loc": ["body"], "msg": "invalid JSON", "type": "x"},
        "plain",
    ]
    assert field_error_lines(detail) == [
        "resources.nproc_per_node: must be ≥ 1",
        "state: bad state",
        "(spec): invalid JSON",
        "plain",
    ]


def test_formatting() -> None:
    assert format_metric("eval_accuracy", 0.97222) == "0.9722 (97.22%)"
    assert format_metric("loss", 0.0123456789) == "0.0123457"
    assert format_metric("loss", None) == "NaN"
    assert format_metric("loss", "Infinity") == "Infinity"
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.5 KiB"
    assert format_bytes(5 * 1024**3) == "5.0 GiB"
    assert format_seconds(75.2) == "1m15s" and format_seconds(3) == "3s"
    assert format_seconds(7300) == "2h01m" and format_seconds(None) == "?"


def test_unreachable_api_exits_2_naming_the_url(tmp_path: Path) -> None:
    url = closed_port_url()
    spec = tmp_path / "job.yaml"
    spec.write_text("name: x\ntask: regression\n")
    for args in (["ls"], ["show", "1"], ["submit", str(spec)], ["cancel", "3"]):
        result = invoke(args, env={"DDPQ_API_URL": url})
        assert result.exit_code == 2, (args, result.output)
        assert url in result.output and "DDPQ_API_URL" in result.output
        assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("missing.yaml", None, "not found"),
        ("broken.yaml", "name: [unclosed\n", "not valid YAML"),
        ("broken.json", '{"name": ', "not valid JSON"),
        ("list.yaml", "- a\n- b\n", "must hold a mapping"),
        ("binary.yaml", b"\xff\xfe\x00\x01", "cannot read"),
        (
            "date.yaml",
            "name: 2024-01-01\ntask: regression\n",
            "name: a date (2024-01-01) is not a JSON value",
        ),
        ("set.yaml", "name: x\ntask: regression\ntags: !!set {a}\n", "tags: a set"),
        ("binary-tag.yaml", "name: !!binary aGk=\ntask: regression\n", "name: a bytes"),
        ("inf.yaml", "name: x\nresources: {mem_gb: .inf}\n", "resources.mem_gb: inf"),
        ("nan.json", '{"name": "x", "config": {"lr": NaN}}', "config.lr: nan"),
        ("yaml-in.json", "name: x\n", "not valid JSON"),
        ("alias.yaml", "a: &a [*a]\n", "recursive"),
        ("deep.yaml", "x: " + "[" * 5000 + "]" * 5000, "nested deeper than 50"),
        (
            "bomb.yaml",
            "a: &a [1,1,1,1,1,1,1,1,1,1]\n"
            + "".join(
                f"{c}: &{c} [{','.join([f'*{p}'] * 10)}]\n"
                for p, c in zip("abcde", "bcdef", strict=True)
            ),
            "expands to more than",
        ),
        ("surrogate.json", '{"name": "\\ud800"}', "name: text must be valid Unicode"),
    ],
)
def test_bad_spec_file_exits_2(
    tmp_path: Path, name: str, content: str | bytes | None, expected: str
) -> None:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    result = invoke(["submit", str(path)], env={"DDPQ_API_URL": closed_port_url()})
    assert result.exit_code == 2, result.output
    assert expected in result.output and "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    line, *fix = result.output.strip().splitlines()
    assert line.startswith("error: ") and expected in line, result.output
    assert fix == [] or (len(fix) == 1 and fix[0].startswith("fix: ")), result.output


@pytest.mark.parametrize("url", ["http://[::1", "http://127.0.0.1:99999", "http://exa mple"])
def test_unusable_api_url_exits_2_saying_so(url: str) -> None:
    for args in (["ls"], ["show", "1"], ["cancel", "1"]):
        result = invoke(args, env={"DDPQ_API_URL": url})
        assert result.exit_code == 2, (args, result.output, result.exception)
        assert "Traceback" not in result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)
        [line] = result.output.strip().splitlines()
        assert line.startswith("error: ") and "DDPQ_API_URL" in line, result.output


def test_bad_environment_exits_2() -> None:
    result = invoke(["ls"], env={"DDPQ_PORT": "not-a-port"})
    assert result.exit_code == 2 and "DDPQ_PORT" in result.output


LOCAL_API = "http://127.0.0.1:8000"


def test_worker_and_up_call_the_worker_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []
    fake_main = types.ModuleType("worker.main")
    fake_up = types.ModuleType("worker.up")

    def run_worker(settings: Any, **kwargs: Any) -> None:
        calls.append(("worker", {**kwargs, "api": settings.resolved_api_url}))

    def run_up(settings: Any, *, worker_token: str) -> None:
        calls.append(("up", {"port": settings.port, "url": settings.resolved_api_url}))
        assert worker_token == "ddpqw_minted"

    # `ddpq up` migrates and mints its worker's token first: no database in a unit test.
    monkeypatch.setattr(cli_main, "_prepare_up", lambda settings: "ddpqw_minted")
    fake_main.run_worker = run_worker  # type: ignore[attr-defined]
    fake_up.run_up = run_up  # type: ignore[attr-defined]
    fake_up.check_port_free = lambda host, port: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "worker.main", fake_main)
    monkeypatch.setitem(sys.modules, "worker.up", fake_up)
    assert invoke(["worker", "--gpus", "0,1", "--slots", "2"]).exit_code == 0
    assert invoke(["worker", "--launcher", "slurm", "--gpus", "none"]).exit_code == 0
    assert invoke(["worker"]).exit_code == 0
    assert invoke(["worker", "--api", "http://api-host:9000"]).exit_code == 0
    assert invoke(["up"], env={"DDPQ_PORT": "8123"}).exit_code == 0
    moved = invoke(
        ["up", "--host", "0.0.0.0", "--port", "8011"],
        env={"DDPQ_PORT": "8123", "DDPQ_API_URL": "http://127.0.0.1:8123"},
    )
    assert moved.exit_code == 0, moved.output
    assert invoke(["up", "--port", "0"]).exit_code == 2
    assert calls == [
        ("worker", {"launcher": "local", "gpus": [0, 1], "slots": 2, "api": LOCAL_API}),
        ("worker", {"launcher": "slurm", "gpus": [], "slots": 1, "api": LOCAL_API}),
        ("worker", {"launcher": "local", "gpus": None, "slots": 1, "api": LOCAL_API}),
        ("worker", {"launcher": "local", "gpus": None, "slots": 1, "api": "http://api-host:9000"}),
        ("up", {"port": 8123, "url": "http://127.0.0.1:8123"}),
        ("up", {"port": 8011, "url": "http://127.0.0.1:8011"}),
    ]
    bad = invoke(["worker", "--gpus", "x"])
    assert bad.exit_code == 2 and "0,1" in bad.output
    assert invoke(["worker", "--launcher", "k8s"]).exit_code == 2


def test_help_of_every_command() -> None:
    commands = [[], ["db"], ["db", "upgrade"], ["serve"], ["up"], ["submit"], ["logs"], ["worker"]]
    for args in commands:
        result = invoke([*args, "--help"])
        assert result.exit_code == 0, (args, result.output)
        assert "Usage" in result.output
        assert "<bool>" not in result.output, f"a flag shows a type: {result.output}"


def test_submit_help_shows_flags_as_flags() -> None:
    text = invoke(["submit", "--help"]).output
    assert re.search(r"^\s*--wait\s+Follow the job until it ends\.", text, re.M), text
    assert re.search(r"^\s*--help\s+Show this message and exit\.", text, re.M), text
    assert re.search(r"^\s*--poll-s <float", text, re.M), "valued options keep their type"
    up = invoke(["up", "--help"]).output
    assert "--host" in up and "--port" in up, up


def test_up_names_its_database_hides_a_password_and_says_when_it_is_new(tmp_path: Path) -> None:
    from service.core.config import Settings

    embedded = Settings(home=tmp_path / "h")
    assert cli_main._embedded_file_missing(embedded)
    note = cli_main.database_note(embedded, new=True)
    assert note.startswith(f"database: sqlite:///{(tmp_path / 'h' / 'ddpq.db').resolve()} ")
    assert "new, empty" in note and "DDPQ_HOME" in note
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "ddpq.db").write_bytes(b"")
    assert not cli_main._embedded_file_missing(embedded)
    assert "new" not in cli_main.database_note(embedded, new=False)

    pg = Settings(database_url="postgresql://ddpq:s3cret@db.example:5432/ddpq")
    assert not cli_main._embedded_file_missing(pg)
    said = cli_main.database_note(pg, new=False)
    assert "s3cret" not in said and "db.example:5432/ddpq" in said
