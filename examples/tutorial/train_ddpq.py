"""The tutorial's DDP script with ddpq's four optional lines: a loss curve, checkpoints that
survive the host, and a clean stop on cancel or preemption. It runs the same way under plain
torchrun (points printed, checkpoints in ./ddpq-checkpoints/) and under ddpq.

    torchrun --nproc-per-node 2 train_ddpq.py --epochs 6
    ddpq run -n 2 -- train_ddpq.py --epochs 6
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpq


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
    parser.add_argument("--epoch-sleep", type=float, default=0.0, help="seconds; for demos")
    args = parser.parse_args()
    cfg = ddpq.config({"lr": 0.05})  # a sweep's values under ddpq, else these

    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    local_rank = int(os.environ["LOCAL_RANK"])
    if dist.get_rank() == 0:
        print(f"lr {cfg['lr']}; {ddpq.info()}", flush=True)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    start_epoch, skip, step = 0, 0, 0
    state = ddpq.load_checkpoint(map_location=device)  # the newest, from any host, or None
    if state is not None:
        model.load_state_dict(state["model"])
    model = DDP(model, device_ids=[local_rank] if use_cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=float(cfg["lr"]))
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        start_epoch, skip, step = state["epoch"], state["batch"], state["step"]
        print(f"resuming at epoch {start_epoch} (step {step})", flush=True)
    data = make_data()
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    loss_fn = nn.MSELoss()

    def snapshot(epoch: int, batch: int) -> dict:
        """Where to go on from: ``batch`` batches of ``epoch`` are done."""
        return {
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "epoch": epoch,
            "batch": batch,
            "step": step,
        }

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # the same order again on resume: skip what was done
        for batch, (x, y) in enumerate(loader):
            if batch < skip:
                continue
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            step += 1
            ddpq.report(step, epoch=epoch, loss=loss.detach())  # rank 0's: the loss curve
            if ddpq.should_stop():  # cancel, preemption, shutdown: the same step on every rank
                ddpq.save_checkpoint(snapshot(epoch, batch + 1), step, epoch=epoch)
                dist.destroy_process_group()
                return
        skip = 0
        time.sleep(args.epoch_sleep)
        ddpq.save_checkpoint(snapshot(epoch + 1, 0), step, epoch=epoch)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
