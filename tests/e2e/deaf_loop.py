"""A user entrypoint that reports ``STEPS`` losses, then stays busy in its own code (an
evaluation, say) and never calls ``ctx.should_stop()``: a stop signal ends it only through the
rank's grace (``DDPQ_STOP_GRACE_S``), with most of those points still in its buffer (the
buffer is handed over at a report, and no report comes).

Once every report is made it writes ``STEPS`` to ``reported`` in its attempt directory.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from service.core.artifacts import attempt_dir

STEPS = 300


def train(ctx: Any) -> None:
    marker = (
        attempt_dir(
            Path(os.environ["DDPQ_ARTIFACT_DIR"]),
            int(os.environ["DDPQ_JOB_ID"]),
            int(os.environ["DDPQ_ATTEMPT"]),
        )
        / "reported"
    )
    for step in range(1, STEPS + 1):
        ctx.report(step, 0, loss=1.0 / step)
    marker.write_text(str(STEPS))
    while True:  # busy elsewhere, deaf to the stop: only the forced exit ends it
        time.sleep(0.1)
