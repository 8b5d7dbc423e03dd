"""The attempt, metric and checkpoint routes translate HTTP to one use case and back: no module
of theirs opens a database session or read scope (the use cases in
``service/store/*/service.py`` own their transactions)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The API modules that reach the database only through use cases.
USE_CASE_ONLY = [
    ROOT / "service/api/attempts",
    ROOT / "service/api/metrics",
    ROOT / "service/api/checkpoints",
    ROOT / "service/api/files.py",
]
SCOPE = re.compile(r"\.(session|read)\(")


def test_no_route_module_of_attempts_metrics_or_checkpoints_opens_a_session() -> None:
    files = [f for p in USE_CASE_ONLY for f in ([p] if p.is_file() else sorted(p.rglob("*.py")))]
    assert len(files) >= 8, f"the modules moved? found only {files}"
    found = [
        f"{f.relative_to(ROOT)}:{n}: {line.strip()}"
        for f in files
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if SCOPE.search(line)
    ]
    assert found == [], (
        "a route opens a database scope itself; call a use case of "
        "service/store/<resource>/service.py instead:\n" + "\n".join(found)
    )
