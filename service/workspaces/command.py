"""What a user typed after ``ddpq run``, as the job spec's ``command`` and resources.

Accepted as typed: ``train.py …``, ``-m pkg.train …``, ``python[3] [-u] train.py …``,
``python -m pkg.train …``, and ``torchrun [options] train.py …`` (also ``python -m
torch.distributed.run …``). The spec's ``command`` is what follows ``torchrun [its options]``:
``["train.py", …]`` or ``["-m", "pkg.train", …]``; the worker runs torchrun itself, so a
leading ``python``/``torchrun`` is not passed twice. Of torchrun's options, ``--nproc-per-node``
(``--nproc_per_node``), ``--nnodes`` and ``--standalone`` become the spec's resources (with
``=value`` or a separate value); every other one is refused with the reason, since ddpq sets
the rendezvous, restarts and logs itself.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from service.core.errors import DdpqError
from service.core.limits import MAX_JOB_NAME_CHARS

if TYPE_CHECKING:
    from service.workspaces.pack import PackedWorkspace

_PYTHON_RE = re.compile(r"^python(\d+(\.\d+)?)?$")
_TORCHRUN_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch"})
# python options that change nothing for a script run by ddpq: dropped.
_PYTHON_NO_OPS = frozenset({"-u"})
# torchrun's options that are refused, with why (by their dashed name).
_TORCHRUN_REFUSED = {
    "--max-restarts": "ddpq relaunches a failed job itself: use --set max_restarts=N",
    "--rdzv-backend": "ddpq sets the rendezvous itself",
    "--rdzv-endpoint": "ddpq sets the rendezvous itself",
    "--rdzv-id": "ddpq sets the rendezvous itself",
    "--rdzv-conf": "ddpq sets the rendezvous itself",
    "--master-addr": "ddpq sets the rendezvous itself",
    "--master-port": "ddpq sets the rendezvous itself",
    "--node-rank": "ddpq assigns node ranks itself",
    "--log-dir": "ddpq keeps each rank's output (`ddpq logs JOB --rank N`)",
    "--redirects": "ddpq keeps each rank's output (`ddpq logs JOB --rank N`)",
    "--tee": "ddpq keeps each rank's output (`ddpq logs JOB --rank N`)",
    "--no-python": "ddpq runs a Python script or module",
}
_TORCHRUN_VALUE_OPTIONS = ("--nproc-per-node", "--nnodes")


class RunCommandError(DdpqError):
    """What was typed after ``ddpq run`` cannot be a command job (the message says why)."""

    status_code = 422
    code = "invalid_command"


@dataclass(frozen=True)
class TypedCommand:
    """A typed command line, understood: ``command`` (the spec's), and what torchrun's own
    options said (None: not given)."""

    command: list[str]
    nproc_per_node: int | None = None
    nnodes: int | None = None
    standalone: bool = False

    @property
    def script(self) -> str | None:
        """The script's path, or None for ``-m module``."""
        return None if self.command[0] == "-m" else self.command[0]


def parse_typed_command(argv: Sequence[str]) -> TypedCommand:
    """Understand ``argv`` (module docstring).

    Raises:
        RunCommandError: nothing to run, an option of python's or torchrun's that ddpq does
            not take (naming it and why), a value that is not a number.
    """
    args = list(argv)
    if not args:
        raise RunCommandError(
            "nothing to run: give the script and its arguments, e.g. "
            "`ddpq run -- train.py --epochs 3` or `ddpq run -- -m pkg.train`"
        )
    head = args[0].rsplit("/", 1)[-1]
    if _PYTHON_RE.match(head):
        return _after_python(args[1:])
    if head == "torchrun":
        return _after_torchrun(args[1:])
    return _script_or_module(args, "")


def _script_or_module(args: list[str], after: str) -> TypedCommand:
    """``-m module …`` or ``script …`` (what follows ``after``, for messages)."""
    if not args:
        raise RunCommandError(f"nothing to run after {after!r}: give the script or -m module")
    first = args[0]
    if first == "-m" or (first.startswith("-m") and len(first) > 2):
        module = first[2:] or (args[1] if len(args) > 1 else "")
        rest = args[1:] if first != "-m" else args[2:]
        if not module or module.startswith("-"):
            raise RunCommandError("-m needs a module name, e.g. -m pkg.train")
        return TypedCommand(command=["-m", module, *rest])
    if first.startswith("-"):
        where = f"{after}'s" if after else "ddpq run's"
        raise RunCommandError(
            f"{first!r} is not one of {where} options: ddpq run's own options go before the "
            "script, the script's after it (e.g. `ddpq run -n 2 -- train.py --epochs 3`)"
        )
    return TypedCommand(command=args)


def _after_python(args: list[str]) -> TypedCommand:
    while args and args[0] in _PYTHON_NO_OPS:
        args = args[1:]
    if args and (args[0] == "-m" or args[0].startswith("-m")):
        module = args[0][2:] or (args[1] if len(args) > 1 else "")
        if module in _TORCHRUN_MODULES:
            return _after_torchrun(args[1:] if args[0] != "-m" else args[2:])
    if args and args[0].startswith("-") and not args[0].startswith("-m"):
        raise RunCommandError(
            f"python's option {args[0]!r} is not passed on: ddpq runs the script under "
            "torchrun with the worker's python; leave it out"
        )
    return _script_or_module(args, "python")


def _split_option(token: str) -> tuple[str, str | None]:
    """``--nproc_per_node=2`` → ``("--nproc-per-node", "2")``; ``--standalone`` → (…, None)."""
    name, eq, value = token.partition("=")
    if name.startswith("--"):
        name = "--" + name[2:].replace("_", "-")
    return name, (value if eq else None)


def _count(option: str, value: str) -> int:
    text = value.strip()
    if ":" in text and option == "--nnodes":  # torchrun's elastic MIN:MAX
        low, _, high = text.partition(":")
        if low == high:
            text = low
        else:
            raise RunCommandError(
                f"torchrun's --nnodes {value}: elastic node ranges are not supported; give "
                "one number (ddpq run --nnodes N)"
            )
    if not text.isdigit() or int(text) < 1:
        flag = "-n N" if option == "--nproc-per-node" else "--nnodes N"
        raise RunCommandError(
            f"torchrun's {option} {value!r}: give a number ≥ 1 (or ddpq run {flag})"
        )
    return int(text)


def _after_torchrun(args: list[str]) -> TypedCommand:
    counts: dict[str, int] = {}
    standalone = module = False
    while args and args[0].startswith("-"):
        token = args.pop(0)
        name, value = _split_option(token)
        if name in _TORCHRUN_VALUE_OPTIONS:
            if value is None:
                if not args:
                    raise RunCommandError(f"torchrun's {name} needs a value")
                value = args.pop(0)
            counts[name] = _count(name, value)
        elif name == "--standalone" and value is None:
            standalone = True
        elif name in ("-m", "--module") and value is None:
            module = True
        else:
            why = _TORCHRUN_REFUSED.get(name, "ddpq run passes only --nproc-per-node, --nnodes "
                                              "and --standalone on to torchrun")  # fmt: skip
            raise RunCommandError(f"torchrun's option {token!r} is not taken: {why}")
    if not args:
        raise RunCommandError("nothing to run after torchrun's options: give the script")
    command = ["-m", *args] if module else args
    typed = _script_or_module(command, "torchrun")
    if standalone and counts.get("--nnodes", 1) != 1:
        raise RunCommandError(
            f"torchrun's --standalone (one node) and --nnodes {counts['--nnodes']} disagree"
        )
    return TypedCommand(
        command=typed.command,
        nproc_per_node=counts.get("--nproc-per-node"),
        nnodes=counts.get("--nnodes"),
        standalone=standalone,
    )


def resolve_resources(
    typed: TypedCommand, *, nproc_per_node: int | None, nnodes: int | None
) -> dict[str, int]:
    """The spec's resources from ddpq run's flags and torchrun's options: only the ones
    given (the spec's defaults apply to the rest). Equal values are not a conflict.

    Raises:
        RunCommandError: a ddpq flag and a torchrun option disagree (naming both).
    """
    resources: dict[str, int] = {}
    if nproc_per_node is not None and typed.nproc_per_node not in (None, nproc_per_node):
        raise RunCommandError(
            f"-n/--nproc-per-node {nproc_per_node} and torchrun's --nproc-per-node "
            f"{typed.nproc_per_node} disagree: give one of them"
        )
    chosen = nproc_per_node if nproc_per_node is not None else typed.nproc_per_node
    if chosen is not None:
        resources["nproc_per_node"] = chosen
    typed_nnodes = 1 if typed.standalone else typed.nnodes
    if nnodes is not None and typed_nnodes not in (None, nnodes):
        theirs = "--standalone (one node)" if typed.standalone else f"--nnodes {typed.nnodes}"
        raise RunCommandError(
            f"--nnodes {nnodes} and torchrun's {theirs} disagree: give one of them"
        )
    chosen = nnodes if nnodes is not None else typed_nnodes
    if chosen is not None:
        resources["nnodes"] = chosen
    return resources


def check_script(command: list[str], paths: Collection[str], root: Path) -> list[str]:
    """``command`` with its script as a normalised path in the workspace (``./train.py`` is
    ``train.py``; an absolute path inside ``root`` becomes relative); a ``-m module``
    command is returned as it is (the module may be installed on the workers).

    Args:
        command: the spec's command (``TypedCommand.command``).
        paths: the workspace's file paths (``Manifest.files``' paths).
        root: the directory packed (the job's working directory).

    Raises:
        RunCommandError: the script is outside ``root`` or not among ``paths``.
    """
    if command[0] == "-m":
        return command
    script = command[0]
    if PurePosixPath(script).is_absolute():
        try:
            relative = Path(script).resolve().relative_to(root).as_posix()
        except ValueError:
            raise RunCommandError(
                f"the script {script} is outside the working directory {root}: run from the "
                "directory that holds it, or pass it with --workdir"
            ) from None
    else:
        relative = posixpath.normpath(script)
    if relative == ".." or relative.startswith("../") or relative not in paths:
        raise RunCommandError(
            f"the script {script!r} is not among the files shipped from {root} (paths are "
            "relative to the working directory; is the file there, and not excluded by "
            ".gitignore or .ddpqignore?)"
        )
    return [relative, *command[1:]]  # normalised: ``./train.py`` is ``train.py``


def default_job_name(command: list[str]) -> str:
    """A job's name when none is given: the script's file name, or the module's name."""
    target = command[1] if command[0] == "-m" and len(command) > 1 else command[0]
    return PurePosixPath(target).name[:MAX_JOB_NAME_CHARS] or "command"


@dataclass(frozen=True)
class CommandPlan:
    """A command job's command (the spec's) and the resources given for it (only those
    given: the spec's defaults fill the rest)."""

    command: list[str]
    resources: dict[str, int]


def plan_command(
    argv: Sequence[str],
    *,
    nproc_per_node: int | None = None,
    nnodes: int | None = None,
    gpus_per_node: int | None = None,
) -> CommandPlan:
    """What was typed, understood, with ddpq run's flags: the spec's command and resources.

    Raises:
        RunCommandError: see ``parse_typed_command`` and ``resolve_resources``.
    """
    typed = parse_typed_command(argv)
    resources = resolve_resources(typed, nproc_per_node=nproc_per_node, nnodes=nnodes)
    if gpus_per_node is not None:
        resources["gpus_per_node"] = gpus_per_node
    return CommandPlan(command=typed.command, resources=resources)


def command_job_spec(
    plan: CommandPlan,
    packed: PackedWorkspace,
    *,
    name: str | None = None,
    launcher: str | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The job spec of a command job over a packed workspace, with the fields given (the
    API's defaults fill the rest): ``{name, command, workspace[, resources][, launcher]
    [, env]}``.

    Raises:
        RunCommandError: the script is not among the packed files (``check_script``).
    """
    paths = {f.path for f in packed.manifest.files}
    command = check_script(plan.command, paths, packed.root)
    spec: dict[str, Any] = {
        "name": name or default_job_name(command),
        "command": command,
        "workspace": packed.digest,
    }
    if plan.resources:
        spec["resources"] = dict(plan.resources)
    if launcher is not None:
        spec["launcher"] = launcher
    if env:
        spec["env"] = dict(env)
    return spec
