"""``python -m worker.runtime``: run this process as one rank (torchrun starts one per rank)."""

from __future__ import annotations

from worker.processes import exit_now
from worker.runtime.main import run_rank


def main() -> None:
    """Run the rank, then leave without interpreter teardown.

    Everything that matters (metrics, checkpoints, result.json or the error file) is durable
    by the time ``run_rank`` returns; skipping teardown avoids torch/gloo destructors that
    sometimes abort a process after a good run, so the exit code stays truthful.
    """
    exit_now(run_rank())


if __name__ == "__main__":
    main()
