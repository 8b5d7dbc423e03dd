"""The bare anchor of benchmark #3: a tiny gloo DDP script that records when step 1 is done.

Run under torchrun: ``torchrun --standalone --nproc_per_node 2 -m bench.first_step OUT``;
rank 0 writes the wall-clock time (``time.time()``, seconds) of its first optimizer step to OUT.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    """Init the process group, take one DDP step, record its time on rank 0."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = DistributedDataParallel(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = nn.functional.mse_loss(model(torch.randn(32, 10)), torch.randn(32, 5))
    loss.backward()
    opt.step()
    value = loss.item()
    if int(os.environ["RANK"]) == 0:
        Path(sys.argv[1]).write_text(f"{time.time()} {value}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
