"""The attempt fence as the attempt API's callers see it: a write or read of an attempt that is
no longer its job's current, active one is refused as ``attempt superseded: …`` (409,
``StaleAttemptError``), and the rank stops. The check itself is ``leases.check_attempt`` /
``lock_attempt`` / ``tokens.current_state``, run inside the use case's own transaction."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from service.core.errors import NotFoundError, StaleAttemptError
from service.core.wire.attempt import ATTEMPT_SUPERSEDED


@contextmanager
def superseded_on_fence() -> Iterator[None]:
    """Turn the fence's refusal raised inside the block into ``attempt superseded: …``. A
    job gone meanwhile (its tokens went with it) is superseded too: the rank must stop.

    Wrap only what the fence guards: a ``NotFoundError`` of something else (no checkpoint
    at that step) raised inside the block would read as superseded.

    Raises:
        StaleAttemptError: the block raised ``StaleAttemptError`` or ``NotFoundError``.
    """
    try:
        yield
    except (StaleAttemptError, NotFoundError) as exc:
        raise StaleAttemptError(f"{ATTEMPT_SUPERSEDED}: {exc.detail}") from None
