"""``python -m worker.runtime``: run this process as one rank (torchrun starts one per rank)."""

from __future__ import annotations

import logging
import os
import sys

from worker.runtime.main import run_rank


def main() -> None:
    """Run the rank, then leave without interpreter teardown.

    Everything that matters (metrics, checkpoints, result.json or the error file) is durable
    by the time ``run_rank`` returns; skipping teardown avoids torch/gloo destructors that
    sometimes abort a process after a good run, so the exit code stays truthful.
    """
    code = run_rank()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
