"""Only the store opens database sessions: routes, the dashboard, the CLI and the worker call
the store's use cases (``service/store/<resource>/service.py``), which open their own.

A scan of the source (no database, no import of the modules): no module under
``service/api``, ``service/web``, ``service/cli`` or ``worker`` calls ``.session(`` on
anything, touches ``.read`` of a database (``db.read``, ``ctx.db.read``, ``_db(request).read``:
the Core read scope, called or passed to an executor), or imports ``sqlalchemy``'s ``Session``.
The import-linter contracts in pyproject.toml keep the imports themselves in their layers.
And the use cases keep their shape: no session in, no ORM row out, frozen values.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("service/api", "service/web", "service/cli", "worker")

# A receiver that is a Database: ``db``, ``self.db``, ``ctx.db``, ``app_db``, ``_db(request)``.
DATABASE_LIKE = re.compile(r"(^|[._])db$|(^|\.)_db\(.*\)$")


def session_uses(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for every database session or read scope that ``source`` opens
    itself, and every import of SQLAlchemy's ``Session``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and _attribute_named(node.func, "session"):
            found.append((node.lineno, f"{ast.unparse(node.func)}(…)"))
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("session", "read")
            and DATABASE_LIKE.search(ast.unparse(node.value))
        ):
            found.append((node.lineno, ast.unparse(node)))
        if (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("sqlalchemy")
            and any(alias.name == "Session" for alias in node.names)
        ):
            found.append((node.lineno, f"from {node.module} import Session"))
    return sorted(set(found))


def _attribute_named(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == name


def scanned_modules() -> list[Path]:
    modules = [p for d in SCANNED for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(modules) > 50, f"found only {len(modules)} modules under {SCANNED}: wrong root?"
    return modules


def test_no_module_outside_the_store_opens_a_session() -> None:
    offenders = []
    for path in scanned_modules():
        rel = path.relative_to(ROOT).as_posix()
        offenders += [f"{rel}:{line}: {what}" for line, what in session_uses(path.read_text())]
    assert not offenders, (
        "these modules open database sessions themselves; call a use case of "
        "service/store/<resource>/service.py instead (one function per operation, opening "
        "its own session):\n" + "\n".join(offenders)
    )


@pytest.mark.parametrize(
    "snippet",
    [
        "with ctx.db.session(write=False) as s: pass",
        "with self.db.session() as s: pass",
        "with _db(request).session() as s: pass",
        "loop.run_in_executor(None, ctx.db.read, read)",
        "row = db.read(lambda conn: conn)",
        "from sqlalchemy.orm import Session",
    ],
)
def test_the_scan_sees_a_session_opened_outside_the_store(snippet: str) -> None:
    assert session_uses(snippet), f"the scan missed {snippet!r}"


@pytest.mark.parametrize(
    "snippet",
    [
        "data = f.read(4096)",
        "response.read()",
        "jobs.describe_job(ctx.db, 1, owner=None, heartbeat_interval_s=1.0)",
    ],
)
def test_the_scan_ignores_file_reads_and_use_case_calls(snippet: str) -> None:
    assert session_uses(snippet) == []


# ---- the use cases' own shape ------------------------------------------------------------


def use_case_modules() -> list[str]:
    found = sorted((ROOT / "service/store").glob("*/service.py"))
    assert len(found) >= 4, f"expected a service.py per resource, found {found}"
    return [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in found]


def _names_in(hint: Any, fields: bool = True, seen: set[int] | None = None) -> Iterator[Any]:
    """``hint``, its type arguments and (``fields``) a dataclass's fields' types,
    recursively."""
    seen = set() if seen is None else seen
    if id(hint) in seen:
        return
    seen.add(id(hint))
    yield hint
    inner = list(typing.get_args(hint))
    if fields and isinstance(hint, type) and dataclasses.is_dataclass(hint):
        inner += typing.get_type_hints(hint).values()
    for arg in inner:
        yield from _names_in(arg, fields, seen)


@pytest.mark.parametrize("module_name", use_case_modules())
def test_use_cases_take_no_session_and_return_no_orm_row(module_name: str) -> None:
    """A use case opens its own session: none comes in, and no ORM row (which would need
    it) or session goes out; every dataclass that comes out is frozen. (Core rows may: the
    metric points travel as plain tuples, measured cheaper than a value per point.)"""
    from sqlalchemy.orm import Session

    from service.store.models import Base

    module = importlib.import_module(module_name)
    functions = [
        f
        for name, f in inspect.getmembers(module, inspect.isfunction)
        if not name.startswith("_") and f.__module__ == module_name
    ]
    assert functions, f"{module_name} defines no use case"
    for f in functions:
        hints = typing.get_type_hints(f)
        for param, hint in hints.items():
            if param != "return":
                assert Session not in set(_names_in(hint, fields=False)), (
                    f"{module_name}.{f.__name__} takes a session ({param}): open one inside"
                )
        for out in _names_in(hints["return"]):
            where = f"{module_name}.{f.__name__} returns {out!r}"
            assert not (isinstance(out, type) and issubclass(out, Base | Session)), where
            if dataclasses.is_dataclass(out):
                assert out.__dataclass_params__.frozen, f"{where}: make it frozen"  # type: ignore[union-attr]
