"""Imported by the fork server of ``worker.runtime.agent`` for the ranks of a built-in task or
an entrypoint, after ``worker.runtime.forkserver_preload``: what ddpq's trainer needs before
its first step and imports lazily, ``torch._dynamo`` above all (DistributedDataParallel's
constructor imports it: ~3 s on a 2-core box). A command job's ranks run the user's script,
which imports what it uses itself, as under plain torchrun: its fork server skips these.
"""

from __future__ import annotations

import torch._dynamo
import torch.nn.parallel  # noqa: F401
