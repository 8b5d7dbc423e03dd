"""Owner B's hostile script (a command job's workspace; ``tests/e2e/test_hostile_owner.py``
and ``bench/hostile.py`` ship it). In turn it:

1. reads owner A's files on this host (``--victim-job``: A's attempt directory, workspace,
   logs, spec and checkpoints, under ``DDPQ_ARTIFACT_DIR``);
2. fills its checkpoint quota (``--checkpoints`` saves of ``--checkpoint-bytes`` each,
   ``--checkpoint-pause-s`` apart);
3. writes ``--log-bytes`` to stdout and stderr as fast as ``os.write`` goes;
4. reports ``--names`` distinct metric names through ``ddpq.report``, ``--names-batch`` per
   call (one step per call);
5. opens files until the open-files limit says no (EMFILE);
6. forks until the process limit says no (EAGAIN), then lets every child go.

What each try found goes to ``hostile-result.json`` beside its workspace (its own attempt
directory) as it goes, and as ``HOSTILE {json}`` lines on stdout. ``--skip`` leaves phases
out by name (``read,checkpoints,log,names,files,forks``).
"""

import argparse
import errno
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import ddpq

RESULT = "hostile-result.json"


def result_path() -> Path:
    """Beside the workspace (the attempt directory) under ddpq; the working directory else."""
    here = Path.cwd()
    return here.parent / RESULT if here.name == "workspace" else here / RESULT


def victim_paths(artifact_dir: Path, victim_job: int, every: int) -> list[Path]:
    """What owner A's job leaves on this host under ``artifact_dir`` that only A's Unix user
    may read (its checkpoint at step ``every`` included)."""
    root = artifact_dir / "jobs" / str(victim_job)
    attempt = root / "attempt-1"
    return [root / "checkpoints", root / "checkpoints" / f"step-{every}.pt", attempt,
            attempt / "workspace", attempt / "workspace" / "honest.py", attempt / "rank-0.log",
            attempt / "launcher.log", attempt / "spec.json"]  # fmt: skip


def try_read(path: Path) -> str:
    """The word "read" when ``path`` could be listed (a directory) or read, else the
    error's name."""
    try:
        if path.is_dir():
            os.listdir(path)
        else:
            with open(path, "rb") as f:
                f.read(1)
    except OSError as exc:
        return type(exc).__name__
    return "read"


def fill_checkpoints(count: int, size_bytes: int, pause_s: float) -> float:
    """``count`` saves of a ``size_bytes`` tensor, ``pause_s`` seconds apart (a save made
    while the previous one still uploads replaces it in the queue: paced, each is sent); the
    seconds it took."""
    started = time.monotonic()
    for step in range(1, count + 1):
        ddpq.save_checkpoint({"blob": torch.full((size_bytes // 4,), float(step))}, step)
        time.sleep(pause_s)
    return time.monotonic() - started


def flood_logs(total_bytes: int) -> float:
    """``total_bytes`` to fds 1 and 2 (half each), 1 MiB per write; the seconds it took."""
    chunk = (b"x" * 1023 + b"\n") * 1024
    started, sent = time.monotonic(), 0
    while sent < total_bytes:
        sent += os.write(1 + (sent // len(chunk)) % 2, chunk[: total_bytes - sent])
    return time.monotonic() - started


def report_names(names: int, batch: int) -> float:
    """``names`` distinct metric names, ``batch`` per ``ddpq.report`` call; the seconds."""
    started = time.monotonic()
    for first in range(0, names, batch):
        metrics: dict[str, Any] = {f"n{i}": 0.5 for i in range(first, min(names, first + batch))}
        ddpq.report(first // batch + 1, **metrics)
    return time.monotonic() - started


def open_files() -> dict[str, object]:
    """Open /dev/null until refused; how many opened and the error that stopped it."""
    fds: list[int] = []
    stop = "none"
    try:
        while len(fds) < 1_000_000:
            fds.append(os.open(os.devnull, os.O_RDONLY))
    except OSError as exc:
        stop = errno.errorcode.get(exc.errno or 0, str(exc))
    finally:
        for fd in fds:
            os.close(fd)
    return {"opened": len(fds), "stopped_by": stop}


def fork_children() -> dict[str, object]:
    """Fork children that wait on a pipe until refused; how many and the error; then let
    them all go and reap them."""
    read_end, write_end = os.pipe()
    children: list[int] = []
    stop = "none"
    try:
        while len(children) < 100_000:
            pid = os.fork()
            if pid == 0:  # the child: wait for the parent to close the pipe, then leave
                os.close(write_end)
                os.read(read_end, 1)
                os._exit(0)
            children.append(pid)
    except OSError as exc:
        stop = errno.errorcode.get(exc.errno or 0, str(exc))
    finally:
        os.close(write_end)
        os.close(read_end)
        for pid in children:
            os.waitpid(pid, 0)
    return {"forked": len(children), "stopped_by": stop}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--victim-job", type=int, required=True)
    parser.add_argument("--victim-every", type=int, default=20)
    parser.add_argument("--checkpoints", type=int, default=6)
    parser.add_argument("--checkpoint-bytes", type=int, default=1 << 20)
    parser.add_argument("--checkpoint-pause-s", type=float, default=1.0)
    parser.add_argument("--log-bytes", type=int, default=1 << 30)
    parser.add_argument("--names", type=int, default=1_000_000)
    parser.add_argument("--names-batch", type=int, default=1000)
    parser.add_argument("--skip", default="")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    found: dict[str, object] = {"uid": os.getuid(), "started_at": time.time()}

    def note(key: str, value: object) -> None:
        found[key] = value
        print("HOSTILE " + json.dumps({key: value}), flush=True)
        result_path().write_text(json.dumps(found))

    if "read" not in skip:
        here = Path(os.environ.get("DDPQ_ARTIFACT_DIR", "."))
        paths = victim_paths(here, args.victim_job, args.victim_every)
        note("read", {str(p): try_read(p) for p in paths})
    if "checkpoints" not in skip:
        spent_s = fill_checkpoints(args.checkpoints, args.checkpoint_bytes, args.checkpoint_pause_s)
        note("checkpoints_s", spent_s)
    if "log" not in skip:
        sys.stdout.flush()
        note("log_s", flood_logs(args.log_bytes))
    if "names" not in skip:
        note("names_s", report_names(args.names, args.names_batch))
    if "files" not in skip:
        note("files", open_files())
    if "forks" not in skip:
        note("forks", fork_children())
    note("ended_at", time.time())


if __name__ == "__main__":
    main()
