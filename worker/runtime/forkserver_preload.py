"""Imported once, by the fork server of ``worker.runtime.agent`` only, before it forks ranks.

It loads what every ddpq rank imports before it runs the job's code, so each forked rank
starts with it in memory: torch and ddpq's runtime. A rank of a built-in task or an
entrypoint also needs ``worker.runtime.forkserver_trainer``'s imports, which the agent adds
for those jobs only (``worker.runtime.agent.preload_modules``).

It also makes the fork server ignore SIGTERM. A cancel or a preemption SIGTERMs the attempt's
whole process group; the fork server must outlive the ranks it forked, because it is what
tells torchrun's agent how each rank exited (a dead fork server reads as exit code 255 for
ranks still saving their stop checkpoint). It still ends with the agent: it exits when the
agent's end of its pipe closes. Each rank restores SIGTERM first thing
(``worker.runtime.agent.rank_main``).

SIGTERM is blocked as well as ignored: a forked rank inherits both, and between its fork and
that restore (unpickling its entry: milliseconds) an ignored SIGTERM (a cancel right as the
ranks start) would be lost, leaving the rank to train on until the launcher's SIGKILL. A
blocked one stays pending in the rank and is delivered when the rank unblocks it.
"""

from __future__ import annotations

import signal

import torch  # noqa: F401

import worker.runtime.main  # noqa: F401

signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
