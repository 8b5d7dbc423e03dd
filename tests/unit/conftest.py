"""``tests/unit`` is the cheap folder: no database, no child process. A test that opens an
engine or starts a process here fails and says where it belongs (``tests/integration``: a
database or the API; ``tests/procs``: real processes such as ranks or the CLI)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from typing import Any, NoReturn

import pytest
from sqlalchemy.pool import Pool

WHERE = (
    "tests/unit runs no database and no child process: move this test to tests/integration "
    "(database, API) or tests/procs (real processes)"
)


def _refuse(*_args: Any, **_kwargs: Any) -> NoReturn:
    raise AssertionError(WHERE)


@pytest.fixture(autouse=True)
def _no_database_or_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse)
    monkeypatch.setattr(os, "fork", _refuse)
    monkeypatch.setattr(os, "posix_spawn", _refuse)
    # An engine may be built (that connects nowhere); checking out a connection may not.
    monkeypatch.setattr(Pool, "connect", _refuse)
    yield
