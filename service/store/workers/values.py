"""The worker resource's values, as its use cases return them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True, slots=True)
class WorkerView:
    """A registered worker and the ids of the active jobs it holds (those the viewer may see).
    ``capacity``: ``{"slots": int, "gpus": [int], "cpus": int}`` as it registered;
    ``stopped_at`` None while it has not shut down cleanly."""

    id: str
    host: str
    pid: int
    launcher: str
    capacity: dict[str, Any]
    started_at: datetime
    heartbeat_at: datetime
    stopped_at: datetime | None
    running_jobs: tuple[int, ...]
    # "live" (beat within LIVE_HEARTBEATS intervals), "lost" (the API no longer hears from
    # it: not counted as a worker that could run anything) or "stopped" (shut down cleanly).
    status: str = "live"


@dataclass(frozen=True, slots=True)
class WorkerCaller:
    """Who calls the worker API: the live worker token (``token_id``) and the worker id it
    names. ``registered``: the id has a row, registered with ``registered_token_id`` (None:
    a row from before worker tokens) and ``launcher``."""

    token_id: int
    worker_id: str
    registered: bool
    registered_token_id: int | None
    launcher: str | None

    @property
    def owns_row(self) -> bool:
        """Whether the row exists and this token registered it."""
        return self.registered and self.registered_token_id == self.token_id
