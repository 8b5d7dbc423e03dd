"""The rules of a command job's fields: ``command`` (what follows ``torchrun [its options]``),
``workspace`` (the digest of the shipped directory) and ``env`` (variables for the ranks).

A command is ``[script, *args]`` with ``script`` a workspace path (``train.py``,
``src/train.py``), or ``["-m", module, *args]``. ddpq runs torchrun itself, so the command
never starts with ``python`` or ``torchrun`` (``ddpq run`` strips them as typed). ``env``
may not set ddpq's own variables (``DDPQ_*``) nor those torchrun sets for every rank: the
ranks' rendezvous and identity are ddpq's to give.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field

from service.core.wire.workspace import SHA256_PATTERN, path_problem

MAX_COMMAND_ITEMS = 200
MAX_COMMAND_ITEM_CHARS = 4096
MAX_ENV_VARS = 100
MAX_ENV_VALUE_CHARS = 4096
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
MODULE_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
# torchrun (torch.distributed.elastic) sets these in every rank it starts.
TORCHRUN_ENV = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_NAME",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "NODE_RANK",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCHELASTIC_ERROR_FILE",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    }
)
RESERVED_ENV_PREFIX = "DDPQ_"
# The setting an operator changes to accept command jobs (service.core.config: user_code).
USER_CODE_SETTING = "DDPQ_USER_CODE"


def _number_as_text(value: Any) -> Any:
    """A number becomes its text (a sweep axis over ``env.LR`` or ``command.2`` gives 0.1)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


def _check_item(item: str) -> str:
    if "\x00" in item:
        raise ValueError("a command item may not hold a NUL character")
    return item


def _check_env_name(name: str) -> str:
    if not ENV_NAME_RE.match(name):
        raise ValueError(
            f"env name {name[:60]!r} is not a variable name (letters, digits and _, not "
            "starting with a digit, at most 128 characters)"
        )
    if name.upper().startswith(RESERVED_ENV_PREFIX):
        raise ValueError(f"env name {name!r}: DDPQ_* variables are ddpq's own")
    if name in TORCHRUN_ENV:
        raise ValueError(f"env name {name!r} is one torchrun sets for every rank")
    return name


CommandItem = Annotated[
    str,
    BeforeValidator(_number_as_text),
    Field(max_length=MAX_COMMAND_ITEM_CHARS),
    AfterValidator(_check_item),
]
Command = Annotated[list[CommandItem], Field(min_length=1, max_length=MAX_COMMAND_ITEMS)]
WorkspaceDigest = Annotated[str, Field(pattern=SHA256_PATTERN)]
EnvName = Annotated[str, AfterValidator(_check_env_name)]
EnvValue = Annotated[
    str,
    BeforeValidator(_number_as_text),
    Field(max_length=MAX_ENV_VALUE_CHARS),
    AfterValidator(_check_item),
]
Env = Annotated[dict[EnvName, EnvValue], Field(max_length=MAX_ENV_VARS)]


def command_problem(command: list[str]) -> str | None:
    """Why ``command`` cannot be run by torchrun as ddpq starts it, or None.

    ``[script, *args]``: ``script`` a workspace path (``path_problem``), not a ``-`` option
    nor ``python``/``torchrun`` (ddpq starts both). ``["-m", module, *args]``: ``module`` a
    dotted Python name.
    """
    first = command[0]
    if first in ("-m", "--module"):
        if len(command) < 2 or not MODULE_RE.match(command[1]):
            return "after -m comes a module name, e.g. ['-m', 'pkg.train', '--epochs', '3']"
        return None
    if first.startswith("-"):
        return (
            f"{first!r}: a command starts with the script (a path in the workspace) or "
            "'-m module'; torchrun's options are the spec's resources"
        )
    if re.match(r"^(python(\d+(\.\d+)?)?|torchrun)$", first):
        return (
            f"{first!r}: ddpq starts python and torchrun itself; the command begins with the "
            "script, e.g. ['train.py', '--epochs', '3']"
        )
    problem = path_problem(first)
    if problem is not None:
        return f"the script {first!r} is not a path inside the workspace: {problem}"
    return None


def command_problems(data: dict[str, Any], *, user_code_allowed: bool) -> list[tuple[str, str]]:
    """The cross-field rules of a spec's ``task``/``command``/``workspace``, on a built
    spec's dump, as ``(field, message)`` pairs: exactly one of ``task`` and ``command``; a
    command needs a workspace and a workspace a command; a command this deployment accepts.
    """
    task, command, workspace = data.get("task"), data.get("command"), data.get("workspace")
    problems: list[tuple[str, str]] = []
    if task is None and command is None:
        problems.append(
            ("task", "give a task (a built-in task or an entrypoint) or a command (your script)")
        )
    elif task is not None and command is not None:
        problems.append(("command", "give either task or command, not both"))
    if command is not None:
        problem = command_problem(command)
        if problem is not None:
            problems.append(("command", problem))
        if workspace is None:
            problems.append(
                ("workspace", "a command job runs in a workspace: upload one (`ddpq run` does)")
            )
        if not user_code_allowed:
            problems.append(
                (
                    "command",
                    "this deployment does not run users' own code (DDPQ_USER_CODE: deny, the "
                    "default with auth on); "
                    f"the operator allows it with {USER_CODE_SETTING}=allow on the API and "
                    "workers (with DDPQ_RANK_USERS, each owner's Unix user, set when auth "
                    "is on)",
                )
            )
    else:
        if workspace is not None:
            problems.append(("workspace", "a workspace is for a command job: give command too"))
        for field in ("checkpoints", "metrics"):
            if data.get(field) is not None:
                problems.append(
                    (field, f"{field} names files of your own script: it is for a command job")
                )
    return problems
