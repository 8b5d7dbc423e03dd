"""The deployment's rules for a job spec: its caps, whether it has Slurm, and which tasks and
entrypoints it runs. Checked on the raw data, so they are reported with pydantic's errors
even when the model did not build."""

from __future__ import annotations

import difflib
import math
import re
from typing import Any

from service.core.config import Settings
from service.core.spec.task_configs import BUILTIN_TASK_CONFIGS

ENTRYPOINT_RE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def _raw_int(section: Any, field: str) -> int | None:
    """``section[field]`` when ``section`` is a mapping and the value a real int (not bool)."""
    if not isinstance(section, dict):
        return None
    value = section.get(field)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _raw_number(section: Any, field: str) -> float | None:
    """``section[field]`` as a float when it is a finite real number (not bool), else None
    (pydantic reports the others)."""
    value = section.get(field) if isinstance(section, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def settings_problems(data: Any, settings: Settings) -> list[tuple[tuple[str, ...], str]]:
    """Rules checked on the raw data, as ``(loc, message)`` pairs: the task name, and the
    deployment's rules (caps, Slurm, allow-list).

    Reads the raw ``data`` so they are reported together with pydantic's errors even when
    the model did not build; values of the wrong type are skipped (pydantic reports those).
    """
    if not isinstance(data, dict):
        return []
    problems: list[tuple[tuple[str, ...], str]] = []
    resources = data.get("resources")
    caps = (
        ("nnodes", settings.max_nnodes),
        ("nproc_per_node", settings.max_nproc_per_node),
        ("gpus_per_node", settings.max_gpus_per_node),
        ("timeout_min", settings.max_timeout_min),
        ("cpus_per_task", settings.max_cpus_per_task),
    )
    for field, cap in caps:
        value = _raw_int(resources, field)
        if value is not None and value > cap:
            problems.append(
                (("resources", field), f"{field}={value} exceeds this deployment's cap of {cap}")
            )
    mem_gb = _raw_number(resources, "mem_gb")
    if mem_gb is not None and mem_gb > settings.max_mem_gb:
        problems.append(
            (
                ("resources", "mem_gb"),
                f"mem_gb={mem_gb:g} exceeds this deployment's cap of {settings.max_mem_gb:g}",
            )
        )
    if data.get("launcher") == "slurm" and not settings.slurm_enabled:
        problems.append(
            (("launcher",), "this deployment has no Slurm (DDPQ_SLURM_ENABLED is off); use 'local'")
        )
    task = data.get("task")
    if isinstance(task, str) and task not in BUILTIN_TASK_CONFIGS and not ENTRYPOINT_RE.match(task):
        close = difflib.get_close_matches(task, BUILTIN_TASK_CONFIGS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        problems.append(
            (
                ("task",),
                f"task {task!r} is neither a built-in task "
                f"({', '.join(sorted(BUILTIN_TASK_CONFIGS))}) nor an entrypoint "
                f"'package.module:function'{hint}",
            )
        )
    if (
        isinstance(task, str)
        and task not in BUILTIN_TASK_CONFIGS
        and ENTRYPOINT_RE.match(task)
        and not settings.entrypoint_allowed(task)
    ):
        allowed = ", ".join(settings.allowed_entrypoints) or "none configured"
        problems.append(
            (
                ("task",),
                f"entrypoint {task!r} is not on this deployment's allow-list "
                f"(DDPQ_ALLOWED_ENTRYPOINTS: {allowed}); the operator allows it with e.g. "
                f"""DDPQ_ALLOWED_ENTRYPOINTS='["{task.partition(":")[0]}:*"]' on the API and """
                f"workers; built-in tasks: {', '.join(sorted(BUILTIN_TASK_CONFIGS))}",
            )
        )
    return problems


# A cap wider than any spec field allows (gpus_per_node's column is 32-bit).
_NO_CAP = 2**62


def spec_rules_only(settings: Settings) -> Settings:
    """``settings`` with every deployment rule of a spec opened up (Slurm on, users' code and
    every entrypoint allowed, no caps): validating under it checks what holds on every
    deployment, as a client does before it sends anything. The deployment's own rules stay
    the API's call (its 422 at submit), since a client's settings are not the server's."""
    return settings.model_copy(
        update={
            "slurm_enabled": True,
            "user_code": "allow",
            "allowed_entrypoints": ["*"],
            "max_nnodes": _NO_CAP,
            "max_nproc_per_node": _NO_CAP,
            "max_gpus_per_node": _NO_CAP,
            "max_timeout_min": _NO_CAP,
            "max_cpus_per_task": _NO_CAP,
            "max_mem_gb": math.inf,
        }
    )
