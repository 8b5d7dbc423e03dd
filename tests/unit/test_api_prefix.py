"""The API prefix is written once in Python (``service.core.wire.API_PREFIX``); the dashboard's
script, which cannot import it, must agree with it."""

from __future__ import annotations

import re
from pathlib import Path

from service.core.wire import API_PREFIX

STATIC = Path(__file__).resolve().parents[2] / "service" / "web" / "static"


def test_dashboard_script_uses_the_same_prefix() -> None:
    text = (STATIC / "ddpq.js").read_text()
    assert re.search(r'const API = "([^"]*)";', text)[1] == API_PREFIX  # type: ignore[index]


def test_prefix_is_a_rooted_path_without_a_trailing_slash() -> None:
    assert API_PREFIX.startswith("/") and not API_PREFIX.endswith("/")
