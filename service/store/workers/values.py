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
