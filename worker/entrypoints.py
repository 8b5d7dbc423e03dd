"""User entrypoints (``"package.module:function"``): whether one resolves, and the errors that
say it does not, shared by the ranks (``worker.runtime.train.context.load_entrypoint`` imports and
runs it) and the local launcher (checks it before it starts any rank).

The launcher's check runs ``python -m worker.entrypoints TASK`` with the ranks' interpreter,
working directory and environment, never in the worker itself: finding a module imports its
parent packages, and user code must not run in the worker. The check finds the module with
``importlib.util.find_spec`` and looks for the function among the module's top-level
definitions in its source (so it does not run the module, which may import torch); only a
module it cannot read that way (no source, ``import *``, a module ``__getattr__``) is imported.
Imports only the standard library and ``service.core.errors``: it starts in a fraction of a
second.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from service.core.errors import DdpqError

CHECK_TIMEOUT_S = 20.0  # a check that takes longer is given up: the ranks will tell


class EntrypointError(DdpqError):
    """A user entrypoint is not allowed here, or cannot be imported."""

    code = "entrypoint"


def import_failed(task: str, exc: BaseException, cwd: str) -> EntrypointError:
    """The error of an entrypoint whose module cannot be imported (``exc``: the ImportError)."""
    module_name = task.partition(":")[0]
    return EntrypointError(
        f"cannot import {module_name!r} for entrypoint {task!r}: {exc}; the worker's "
        f"ranks must be able to import it: install it in the worker's venv or put its "
        f"directory on the worker's PYTHONPATH (working directory {cwd})"
    )


def no_function(task: str) -> EntrypointError:
    """The error of an entrypoint whose module has no such function."""
    module_name, _, func_name = task.partition(":")
    return EntrypointError(f"{module_name!r} has no function {func_name!r}")


def _top_level_names(source: str) -> set[str] | None:
    """Names a module's source binds at top level; None when that cannot be told statically
    (``from x import *`` or a module ``__getattr__``)."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add((alias.asname or alias.name).split(".")[0])
        else:
            for sub in ast.walk(node):  # assignments, also under if/try at top level
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.add(sub.id)
    return None if "__getattr__" in names else names


def resolve_problem(task: str, cwd: str) -> EntrypointError | None:
    """Why ``task`` would not load in a rank started in ``cwd``, or None when it resolves.

    Runs in the checking subprocess (it imports the module's parent packages).
    """
    module_name, _, func_name = task.partition(":")
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # as load_entrypoint does
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:
        return import_failed(task, exc, cwd)
    if spec is None:
        return import_failed(task, ModuleNotFoundError(f"No module named {module_name!r}"), cwd)
    names: set[str] | None = None
    if spec.origin and spec.origin.endswith(".py"):
        try:
            with open(spec.origin, encoding="utf-8") as f:
                names = _top_level_names(f.read())
        except (OSError, SyntaxError, ValueError):
            names = None  # importing it tells (a syntax error is the ranks' to report)
    if names is not None:
        return None if func_name in names else no_function(task)
    try:
        module = importlib.import_module(module_name)
    except Exception:
        return None  # not a resolution problem: the ranks report it with its traceback
    return None if callable(getattr(module, func_name, None)) else no_function(task)


def check_in_subprocess(
    task: str,
    *,
    python: str,
    cwd: str,
    env: Mapping[str, str],
    identity: Mapping[str, Any] | None = None,
    timeout_s: float = CHECK_TIMEOUT_S,
) -> EntrypointError | None:
    """Run ``resolve_problem`` in a child ``python`` with the ranks' ``cwd`` and ``env``, as
    the ranks' user (``identity``: Popen's ``user``/``group``/``extra_groups``, if any), so a
    module that must be imported to tell is never imported with the worker's rights.

    Returns:
        The error the ranks would raise, or None when the entrypoint resolves, or when the
        check itself could not tell (it failed to start, crashed or took over ``timeout_s``
        seconds): then the ranks decide, as without the check.
    """
    argv: Sequence[str] = [python, "-m", "worker.entrypoints", task]
    try:
        done = subprocess.run(argv, cwd=cwd, env=dict(env), capture_output=True, text=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL, check=False,
                              **dict(identity or {}))  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else {}
    except ValueError:
        return None
    problem = answer.get("problem") if isinstance(answer, dict) else None
    return EntrypointError(problem) if isinstance(problem, str) else None


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m worker.entrypoints TASK``: print ``{"problem": text | null}`` as JSON."""
    task = (sys.argv[1:] if argv is None else list(argv))[0]
    problem = resolve_problem(task, os.getcwd())
    print(json.dumps({"problem": problem.detail if problem is not None else None}))


if __name__ == "__main__":
    main()
