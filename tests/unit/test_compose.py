"""docker-compose.yml and Dockerfile agree with the code: every `ddpq ...` command they run
exists and parses, every DDPQ_* variable they set is a Settings field (no Docker engine here)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from service.cli.main import app
from service.core.config import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]


def command_of(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def ddpq_calls(service: dict[str, Any]) -> list[list[str]]:
    """Every `ddpq …` invocation a service runs: its command, or each one in its `sh -c`
    script (redirections and `exec` dropped)."""
    command = command_of(service)
    if command[:2] != ["sh", "-c"]:
        return [command] if command[:1] == ["ddpq"] else []
    calls = []
    for part in re.split(r"&&|;|\|\|", command[2]):
        words = shlex.split(part.split(">")[0])
        if words[:1] == ["exec"]:
            words = words[1:]
        if words[:1] == ["ddpq"]:
            calls.append(words)
    return calls


def environment_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        return dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def ddpq_commands() -> list[tuple[str, list[str]]]:
    found = [(name, call[1:]) for name, svc in SERVICES.items() for call in ddpq_calls(svc)]
    dockerfile_cmd = re.search(r"^CMD (\[.*\])$", (ROOT / "Dockerfile").read_text(), re.M)
    assert dockerfile_cmd, "the Dockerfile should end with a CMD [...] line"
    cmd = yaml.safe_load(dockerfile_cmd.group(1))
    assert cmd[0] == "ddpq"
    return [*found, ("Dockerfile CMD", cmd[1:])]


def test_the_four_services_and_their_order() -> None:
    assert {"postgres", "migrate", "api", "worker"} <= set(SERVICES)
    health = SERVICES["postgres"]["healthcheck"]["test"]
    assert "pg_isready" in " ".join(health)
    assert SERVICES["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("api", "worker"):
        dep = SERVICES[name]["depends_on"]["migrate"]["condition"]
        assert dep == "service_completed_successfully", f"{name} must wait for the migration"
    migrate = ddpq_calls(SERVICES["migrate"])
    assert migrate[0] == ["ddpq", "db", "upgrade"]
    assert migrate[1][:4] == ["ddpq", "token", "create", "--worker"]
    assert command_of(SERVICES["api"])[:2] == ["ddpq", "serve"]
    assert "0.0.0.0" in command_of(SERVICES["api"])
    assert [call[:2] for call in ddpq_calls(SERVICES["worker"])] == [["ddpq", "worker"]]


@pytest.mark.parametrize(("where", "args"), ddpq_commands(), ids=lambda v: str(v))
def test_every_ddpq_command_exists_and_parses(where: str, args: list[str]) -> None:
    result = CliRunner().invoke(app, [*args, "--help"])
    assert result.exit_code == 0, (
        f"{where}: `ddpq {' '.join(args)} --help` failed:\n{result.output}"
    )
    # Parse (types, ranges, choices) without running it.
    group = typer.main.get_command(app)
    ctx = group.make_context("ddpq", list(args), resilient_parsing=False)
    command: Any = group
    rest = list(args)
    while hasattr(command, "resolve_command"):  # a group (Typer vendors its own click)
        name, sub, rest = command.resolve_command(ctx, rest)
        assert sub is not None, f"{where}: no ddpq command {name!r}"
        command = sub
        ctx = command.make_context(name or "", rest, parent=ctx)


def test_every_ddpq_variable_is_a_setting() -> None:
    fields = set(Settings.model_fields)
    env_sources = {name: environment_of(svc) for name, svc in SERVICES.items()}
    env_sources["Dockerfile ENV"] = dict(
        re.findall(r"\b(DDPQ_\w+)=(\S+)", (ROOT / "Dockerfile").read_text())
    )
    seen = 0
    for where, env in env_sources.items():
        for var, value in env.items():
            if not var.startswith("DDPQ_"):
                continue
            seen += 1
            field = var.removeprefix("DDPQ_").lower()
            assert field in fields, f"{where} sets {var}, which no Settings field reads"
            Settings.model_validate({field: value})  # and the value is valid for it
    assert seen >= 4


def test_only_the_api_side_holds_the_database() -> None:
    urls = {environment_of(SERVICES[n])["DDPQ_DATABASE_URL"] for n in ("migrate", "api")}
    assert len(urls) == 1 and "@postgres:" in urls.pop()
    worker = SERVICES["worker"]
    assert "DDPQ_DATABASE_URL" not in environment_of(worker), "a worker refuses a database URL"
    assert "postgres" not in str(worker), "the worker holds nothing of the database's"
    mounts = [set(SERVICES[n].get("volumes", [])) for n in ("api", "worker")]
    assert mounts[0] & mounts[1], "api and worker must share the artifacts volume"


def test_the_worker_holds_the_api_url_and_a_worker_token() -> None:
    worker = SERVICES["worker"]
    (call,) = ddpq_calls(worker)
    assert call[call.index("--api") + 1] == "http://api:8000", (
        "the worker and its ranks reach the api service at http://api:8000"
    )
    script = command_of(worker)[2]
    assert "DDPQ_WORKER_TOKEN" in script
    # The token file comes from the one-shot migrate service, through a volume only they mount.
    token_volume = {v.split(":")[0] for v in worker["volumes"]} & {
        v.split(":")[0] for v in SERVICES["migrate"]["volumes"]
    }
    assert token_volume and not token_volume & {v.split(":")[0] for v in SERVICES["api"]["volumes"]}
    depends = worker.get("depends_on", {})
    assert "api" in depends, "the worker should start once the API it reaches is up"
