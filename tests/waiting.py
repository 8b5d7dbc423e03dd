"""The one polling helper of the suite: wait for something a real process, server or cluster
does on its own time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(
    predicate: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.2
) -> Any:
    """Call ``predicate`` every ``every_s`` seconds until it returns something truthy, and
    return that.

    Raises:
        AssertionError: nothing truthy within ``timeout_s`` seconds (the message says ``what``
            was awaited).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)
