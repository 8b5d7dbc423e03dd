"""Built-in task "charlm": a small causal transformer over the Python standard library's source."""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from service.core.spec.task_configs import CharLMConfig
from worker.runtime.train.context import TrainContext
from worker.tasks.base import TaskParts, TaskSetup, run_task

VOCAB_SIZE = 256  # bytes
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_dir() -> Path:
    """Where this interpreter's standard library lives (every machine has one)."""
    return Path(sysconfig.get_paths()["stdlib"])


def iter_source_files(root: Path) -> Iterator[Path]:
    """``.py`` files under ``root`` in sorted order of their relative paths (as strings),
    skipping installed packages and caches; lazy, so a small corpus lists few directories."""
    entries: list[tuple[str, Path, bool]] = []
    with os.scandir(root) as it:
        for entry in it:
            is_dir = entry.is_dir(follow_symlinks=False)
            if is_dir and entry.name in SKIP_DIRS:
                continue
            if is_dir or (entry.name.endswith(".py") and entry.is_file()):
                # "a/…" sorts after "a.py" exactly when "/" would in the full path string.
                entries.append((entry.name + ("/" if is_dir else ""), Path(entry.path), is_dir))
    for _key, path, is_dir in sorted(entries):
        if is_dir:
            yield from iter_source_files(path)
        else:
            yield path


def read_corpus(n_bytes: int, root: Path | None = None) -> bytes:
    """The first ``n_bytes`` of the sorted stdlib sources, concatenated (fewer if it is
    smaller)."""
    chunks: list[bytes] = []
    total = 0
    for path in iter_source_files(root or stdlib_dir()):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data[: n_bytes - total])
        total += len(chunks[-1])
        if total >= n_bytes:
            break
    return b"".join(chunks)


class ByteWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of ``context`` bytes: input ``(context,)`` int64 bytes and the
    target shifted by one byte, ``(context,)`` int64."""

    def __init__(self, data: bytes, context: int) -> None:
        if len(data) < context + 1:
            raise ValueError(f"corpus of {len(data)} bytes is shorter than context {context} + 1")
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.context = context

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.context

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.context
        window = self.data[start : start + self.context + 1].long()
        return window[:-1], window[1:]


class CharTransformer(nn.Module):
    """Bytes (B, T) → next-byte logits (B, T, 256): token + learned position embeddings, a
    pre-norm ``nn.TransformerEncoder`` with a causal mask, a final LayerNorm and a linear head."""

    def __init__(self, cfg: CharLMConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"d_model={cfg.d_model} must be divisible by n_heads={cfg.n_heads}")
        self.context = cfg.context
        self.tokens = nn.Embedding(VOCAB_SIZE, cfg.d_model)
        self.positions = nn.Embedding(cfg.context, cfg.d_model)
        layer = nn.TransformerEncoderLayer(
            cfg.d_model,
            cfg.n_heads,
            dim_feedforward=4 * cfg.d_model,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, cfg.n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, VOCAB_SIZE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = x.shape[1]
        pos = torch.arange(steps, device=x.device)
        h = self.tokens(x) + self.positions(pos)
        mask = nn.Transformer.generate_square_subsequent_mask(steps, device=x.device)
        h = self.encoder(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))


def next_byte_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (B, T, 256) logits against (B, T) next bytes."""
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB_SIZE).float(), targets.reshape(-1))


def build(setup: TaskSetup) -> TaskParts:
    """The charlm task for one rank: reports loss and tokens_per_s."""
    cfg = CharLMConfig.model_validate(dict(setup.config))
    return TaskParts(
        model=CharTransformer(cfg),
        train_set=ByteWindows(read_corpus(cfg.corpus_bytes), cfg.context),
        loss_fn=next_byte_loss,
        tokens_per_sample=cfg.context,
    )


def train(ctx: TrainContext) -> None:
    """Entrypoint: train the charlm task over ``ctx`` (``task: "charlm"``)."""
    run_task(build, ctx)
