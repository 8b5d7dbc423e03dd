"""The submitit adapter: every private submitit name ddpq uses exists in the installed
submitit, and the wrappers behave as the launcher relies on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from worker.launchers.slurm import submitit_adapter
from worker.launchers.slurm.submitit_adapter import (
    convert_mem,
    missing_private_names,
    parse_node_list,
    submitit_version,
    task_command,
)


def test_every_private_submitit_name_exists() -> None:
    missing = missing_private_names()
    assert not missing, (
        f"submitit {submitit_version()} lacks {', '.join(missing)}: update "
        "worker/launchers/slurm/submitit_adapter.py for this submitit release (or pin submitit)"
    )


# A private submitit name: ``submitit.x._y``, ``from submitit.x import _y``, ``executor._y``.
PRIVATE_USE = re.compile(
    r"\bsubmitit(?:\.\w+)*\._\w|from submitit[\w.]* import [^\n]*\b_\w|executor\._\w"
)


def test_no_launcher_module_but_the_adapter_uses_a_private_submitit_name() -> None:
    launchers = Path(__file__).resolve().parents[2] / "worker" / "launchers"
    offenders = [
        f"{path.name}: {m.group(0)}"
        for path in sorted(launchers.glob("*.py"))
        if path.name != "submitit_adapter.py"
        for m in PRIVATE_USE.finditer(path.read_text())
    ]
    assert not offenders, f"use worker/launchers/slurm/submitit_adapter.py instead: {offenders}"


def test_a_missing_name_is_reported_by_module_and_name(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = (("submitit.slurm.slurm", "_no_such_name"), ("submitit.no_such_module", ""))
    monkeypatch.setattr(submitit_adapter, "PRIVATE_NAMES", fake)
    assert missing_private_names() == [
        "submitit.slurm.slurm:_no_such_name",
        "submitit.no_such_module",
    ]


def test_wrappers() -> None:
    assert convert_mem(4) == "4GB" and convert_mem(1.5) == "1536MB"
    assert parse_node_list("ddpq-n[1-2],gpu7") == ["ddpq-n1", "ddpq-n2", "gpu7"]
    assert task_command("/opt/py thon", Path("/a/b")) == (
        "'/opt/py thon' -u -m submitit.core._submit /a/b"
    )
