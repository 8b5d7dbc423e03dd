"""A command job's zero-change paths: the files its script already writes that ddpq follows.

``checkpoints.path``: a workspace-relative file (``snapshot.pt``) or glob (``ckpt/*.pt``)
the script saves; each completed new version is uploaded as a checkpoint and the newest is put
back at its path before the next attempt, on any host. ``metrics.tensorboard``: a
workspace-relative directory where the script writes TensorBoard event files
(``SummaryWriter("runs")``); rank 0's side reads their scalars as metric points.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from functools import cache
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from service.core.wire.workspace import path_problem

# Glob characters a followed checkpoint path may use (fnmatch's, as pathlib.Path.glob reads them).
GLOB_CHARS = frozenset("*?[")


def _workspace_path(value: str) -> str:
    stripped = value.rstrip("/") if len(value) > 1 else value
    while stripped.startswith("./") and len(stripped) > 2:  # as typed in a shell: ./snapshot.pt
        stripped = stripped[2:]
    problem = path_problem(stripped)
    if problem is not None:
        raise ValueError(f"{value!r} is not a path inside the workspace: {problem}")
    return stripped


def glob_parts(pattern: str) -> tuple[str, ...]:
    """A followed path's parts, for ``glob_matches``.

    Raises:
        ValueError: ``pattern`` is not a workspace path (``path_problem``).
    """
    problem = path_problem(pattern)
    if problem is not None:
        raise ValueError(f"followed path {pattern!r} is not a workspace path: {problem}")
    return tuple(pattern.split("/"))


def glob_matches(pattern: tuple[str, ...], name: str) -> bool:
    """Whether the workspace-relative ``name`` matches ``pattern`` (its ``glob_parts``):
    fnmatch per part, ``**`` zero or more directories (never the file's own name), as
    ``pathlib.Path.glob`` reads a pattern."""
    parts = name.split("/")

    @cache
    def match(i: int, j: int) -> bool:
        if i == len(pattern):
            return j == len(parts)
        if pattern[i] == "**":
            return match(i + 1, j) or (j < len(parts) - 1 and match(i, j + 1))
        return j < len(parts) and fnmatchcase(parts[j], pattern[i]) and match(i + 1, j + 1)

    return match(0, 0)


def is_glob(path: str) -> bool:
    """Whether a followed checkpoint path is a pattern (``ckpt/*.pt``) rather than one file."""
    return any(ch in GLOB_CHARS for ch in path)


WorkspacePath = Annotated[
    str, Field(min_length=1, max_length=1024), AfterValidator(_workspace_path)
]


class FollowedCheckpoints(BaseModel):
    """``checkpoints`` of a command job: the file (or glob) its script saves, relative to the
    workspace, e.g. ``{"path": "snapshot.pt"}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    path: WorkspacePath = Field(
        description="A file (or glob, e.g. 'ckpt/*.pt') your script writes, relative to the "
        "workspace: each new version becomes a checkpoint and the newest is restored there "
        "before the next attempt."
    )


class ScriptMetrics(BaseModel):
    """``metrics`` of a command job: where its script writes TensorBoard scalars."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    tensorboard: WorkspacePath = Field(
        description="The directory your script's SummaryWriter writes to (e.g. 'runs'), "
        "relative to the workspace: its scalars become the job's metrics (tag → name)."
    )
