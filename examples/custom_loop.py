"""An example user entrypoint (``task: examples.custom_loop:train``): your own DDP loop.

ddpq runs only the entrypoints its deployment allows. Allow this one when you start ddpq
(from the repository root, so ``examples`` is importable), then submit it::

    DDPQ_ALLOWED_ENTRYPOINTS='["examples.*:*"]' ddpq up
    ddpq submit examples/custom_loop.yaml --wait

(With ``ddpq serve`` and ``ddpq worker`` apart, set the variable for both.)

ddpq starts one process per rank and calls ``train(ctx)`` in each, with the process group
already up. The loop below is plain PyTorch plus five calls on ``ctx``: ``wrap_model``,
``distributed_sampler``, ``report``, ``save_checkpoint``/``load_checkpoint`` and
``should_stop``. Like the built-in tasks it reports ``loss`` every step and ``eval_loss``
and ``eval_accuracy`` (on the held-out 20 %) every epoch. Data: scikit-learn's bundled
breast-cancer table (569 × 30, no download).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from worker.runtime.train.context import TrainContext


def load_data(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Standardised features (N, 30) float32 and labels (N,) int64; 80/20 split by ``seed``."""
    from sklearn.datasets import load_breast_cancer
    from sklearn.model_selection import train_test_split

    x, y = load_breast_cancer(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    mean, std = x_tr.mean(axis=0), x_tr.std(axis=0) + 1e-6

    def to_set(a: Any, b: Any) -> TensorDataset:
        features = torch.as_tensor((a - mean) / std, dtype=torch.float32)
        return TensorDataset(features, torch.as_tensor(b, dtype=torch.int64))

    return to_set(x_tr, y_tr), to_set(x_te, y_te)


def evaluate(model: nn.Module, test_set: TensorDataset, device: torch.device) -> dict[str, float]:
    """``eval_loss`` and ``eval_accuracy`` of ``model`` on the whole test set (every rank
    holds the same weights, so every rank gets the same numbers without a collective)."""
    features, labels = (t.to(device) for t in test_set.tensors)
    model.eval()
    with torch.no_grad():
        logits = model(features)
    model.train()
    return {
        "eval_loss": float(nn.functional.cross_entropy(logits, labels)),
        "eval_accuracy": float((logits.argmax(dim=-1) == labels).float().mean()),
    }


def train(ctx: TrainContext) -> dict[str, float]:
    """Train a 30→hidden→2 classifier; returns the final ``eval_accuracy`` (in result.json)."""
    t = ctx.spec.training
    torch.manual_seed(t.seed)
    train_set, test_set = load_data(t.seed)
    hidden = int(ctx.config.get("hidden", 32))
    model = nn.Sequential(nn.Linear(30, hidden), nn.ReLU(), nn.Linear(hidden, 2))
    ddp_model = ctx.wrap_model(model)  # moves `model` to ctx.device, wraps it in DDP
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=t.lr)
    sampler = ctx.distributed_sampler(train_set)
    loader = DataLoader(train_set, batch_size=t.batch_size, sampler=sampler)
    ctx.total_steps = t.epochs * len(loader)  # for the progress bar and ETA

    step, first_epoch = 0, 0
    final: dict[str, float] = {}
    state = ctx.load_checkpoint()  # every rank gets the same one (None on a fresh start)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, first_epoch = state["step"], state["next_epoch"]

    def checkpoint(next_epoch: int) -> None:
        ctx.save_checkpoint(
            {
                "model": model.state_dict(),  # the bare model: loads without DDP
                "optimizer": optimizer.state_dict(),
                "step": step,
                "next_epoch": next_epoch,
            },
            step=step,
            epoch=next_epoch,
        )

    for epoch in range(first_epoch, t.epochs):
        sampler.set_epoch(epoch)
        for features, labels in loader:
            features, labels = features.to(ctx.device), labels.to(ctx.device)
            loss = nn.functional.cross_entropy(ddp_model(features), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            ctx.report(step, epoch, loss=ctx.all_reduce_mean(loss))
            if ctx.should_stop():  # cancel or preemption: same answer on every rank
                checkpoint(next_epoch=epoch)  # this epoch is redone on resume
                return {}
        final = evaluate(model, test_set, ctx.device)
        ctx.report(step, epoch, **final)
        checkpoint(next_epoch=epoch + 1)
    final = final or evaluate(model, test_set, ctx.device)  # resumed after the last epoch
    return {"eval_accuracy": final["eval_accuracy"]}
