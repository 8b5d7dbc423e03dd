"""docs/architecture.md's package map is the code's: every package has a docstring that says
what it owns, and the page lists every package with its modules (scripts/architecture_map.py
--write regenerates it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "architecture_map", ROOT / "scripts" / "architecture_map.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_lists_every_package_as_the_code_has_it() -> None:
    arch = _script()
    page = arch.DOC.read_text()
    assert arch.with_map(page, arch.package_map()) == page, (
        "docs/architecture.md's package map is stale: "
        "run python scripts/architecture_map.py --write"
    )


def test_a_new_module_or_package_changes_the_map(tmp_path: Path) -> None:
    arch = _script()
    pkg = tmp_path / "service" / "things"
    pkg.mkdir(parents=True)
    (tmp_path / "service" / "__init__.py").write_text('"""Top. More words."""\n')
    (pkg / "__init__.py").write_text('"""Things: kept here. Details follow."""\n')
    (pkg / "store.py").write_text("")
    (tmp_path / "worker").mkdir()
    assert arch.package_map(tmp_path).splitlines() == [
        "- `service/`: Top.",
        "- `service/things/`: Things: kept here. Modules: store.",
    ]


def test_a_package_without_a_docstring_is_refused(tmp_path: Path) -> None:
    arch = _script()
    (tmp_path / "service").mkdir()
    (tmp_path / "service" / "__init__.py").write_text("")
    (tmp_path / "worker").mkdir()
    with pytest.raises(ValueError, match=r"service/__init__\.py has no docstring"):
        arch.package_map(tmp_path)
