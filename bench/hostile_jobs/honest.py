"""Owner A's honest training script (a command job's workspace; the e2e test
``tests/e2e/test_hostile_owner.py`` and ``bench/hostile.py`` ship it): a small regression
loop that reports its loss at every step and checkpoints every ``--every`` steps.

    python honest.py --steps 200 --every 20 --pause-s 0.02 [--until release]

``--pause-s`` (seconds per step) paces it; 0 makes it CPU-bound, which is what the benchmark
times. With ``--until FILE`` it goes on past ``--steps`` until ``FILE`` (relative to its
working directory, the workspace) exists, at most ``--max-steps``: whoever runs it says when
the hostile job beside it is done. ``--batch`` sizes each step's work.
"""

import argparse
import time
from pathlib import Path

import torch

import ddpq


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    parser.add_argument("--pause-s", type=float, default=0.0)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--until", type=Path, default=None)
    parser.add_argument("--max-steps", type=int, default=100_000)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(args.batch, 64)
    y = x.sum(dim=1, keepdim=True)
    started, step = time.monotonic(), 0
    while step < args.max_steps and (
        step < args.steps or (args.until is not None and not args.until.exists())
    ):
        step += 1
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ddpq.report(step, loss=loss.detach())
        if step % args.every == 0:
            ddpq.save_checkpoint({"model": model.state_dict(), "step": step}, step)
        if args.pause_s:
            time.sleep(args.pause_s)
    print(f"honest: {step} steps in {time.monotonic() - started:.2f} s", flush=True)


if __name__ == "__main__":
    main()
