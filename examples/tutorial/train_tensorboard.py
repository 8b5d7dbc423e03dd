"""The tutorial's DDP script as many are written: it logs its loss with TensorBoard and keeps
a ``snapshot.pt`` it resumes from when the file exists. Nothing of ddpq in it.

Run it with torchrun:   torchrun --nproc-per-node 2 train_tensorboard.py --epochs 6
or with ddpq, as is:    ddpq run -n 2 --checkpoint-path snapshot.pt --tensorboard runs \\
                            -- train_tensorboard.py --epochs 6

With those two options ddpq charts the loss from ``runs/`` and uploads each new
``snapshot.pt`` as a checkpoint; a relaunch on another host finds it restored and goes on
from the next epoch.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torch.utils.tensorboard import SummaryWriter

SNAPSHOT = "snapshot.pt"


def make_data(n: int = 2048, features: int = 16) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--epoch-sleep", type=float, default=0.0, help="seconds; for demos")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    epochs_run = 0
    if os.path.exists(SNAPSHOT):  # the tutorial's resume: load the snapshot if there is one
        snapshot = torch.load(SNAPSHOT, map_location=device)
        model.load_state_dict(snapshot["MODEL_STATE"])
        epochs_run = snapshot["EPOCHS_RUN"]
        print(f"resuming from snapshot at epoch {epochs_run}", flush=True)
    model = DDP(model, device_ids=[local_rank] if use_cuda else None)
    data = make_data()
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()
    writer = SummaryWriter("runs") if rank == 0 else None

    for epoch in range(epochs_run, args.epochs):
        sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.item()
            batches += 1
        time.sleep(args.epoch_sleep)
        if writer is not None:
            writer.add_scalar("loss", total / batches, epoch + 1)
            writer.flush()  # TensorBoard otherwise holds scalars up to 2 minutes
            print(f"epoch {epoch} loss {total / batches:.4f}", flush=True)
            torch.save(
                {"MODEL_STATE": model.module.state_dict(), "EPOCHS_RUN": epoch + 1}, SNAPSHOT
            )

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
