"""Benchmark #7's knee: ``bench.scale`` at several sink counts, this checkout's server against
another checkout's (today's code) in the same run, interleaved rung by rung (the order
alternating), each run a process of its own with the load average before and after it.

The knee is the first rung whose lag p99 passes the goal. Lag is measured from the report,
so it holds the sink's flush interval (up to ``FLUSH_INTERVAL_S`` in its buffer) whatever
the server does; the ladder reports the rung where lag p99 passes ``FLUSH_INTERVAL_S`` +
2 s (the server and the queues in front of it took more than 2 s) and the rung where the
POST → visible part alone passes 2 s.

Run: ``python -m bench.scale_ladder --base /work/base --sinks 250 500 1000 --duration-s 30``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from worker.runtime.metrics.buffer import FLUSH_INTERVAL_S

GOAL_S = 2.0
KEYS = (
    "sinks", "points_per_s_stored", "drain_s", "posts_per_s", "batch_points_median",
    "rejected_429", "lag_s_p50", "lag_s_p99", "post_to_visible_s_p99", "poll_ms_p99",
    "serve_cpu_s_per_1k_points", "postgres_cpu_s_per_1k_points",
    "load_process_cpu_s_per_1k_points", "serve_cores_busy", "postgres_cores_busy",
    "load_process_cores_busy",
)  # fmt: skip


def one_run(code: str, base: Path, sinks: int, duration_s: float, out: Path) -> dict[str, Any]:
    """``bench.scale`` once, as a process of its own; its figures with the load averages."""
    argv = [sys.executable, "-m", "bench.scale", "--size", "default", "--sinks", str(sinks),
            "--duration-s", str(duration_s), "--json", str(out)]  # fmt: skip
    if code == "base":
        argv += ["--server-root", str(base), "--wire", "rows"]
    load_before = os.getloadavg()[0]
    started = time.strftime("%H:%M:%S", time.gmtime())
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    figures: dict[str, Any] = json.loads(out.read_text())["figures"]
    row = {k: figures.get(k) for k in KEYS}
    row |= {"code": code, "started_utc": started, "load_1m_before": round(load_before, 2),
            "load_1m_after": round(os.getloadavg()[0], 2),
            "exactly_once": figures["missing"] == figures["duplicates"] == 0}  # fmt: skip
    return row


def knee(rows: list[dict[str, Any]], key: str, limit_s: float) -> int | None:
    """The fewest sinks whose ``key`` passed ``limit_s`` (None: no rung did)."""
    over = [r["sinks"] for r in rows if (r[key] or 0.0) > limit_s]
    return min(over) if over else None


def main() -> None:
    """CLI: see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base", type=Path, required=True, help="today's code (a checkout)")
    p.add_argument("--sinks", type=int, nargs="+", default=[250, 500, 750, 1000])
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--out", type=Path, default=Path("/tmp/scale-ladder"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for i, sinks in enumerate(args.sinks):
        order = ("base", "new") if i % 2 == 0 else ("new", "base")
        for code in order:
            row = one_run(code, args.base, sinks, args.duration_s,
                          args.out / f"scale-{code}-{sinks}.json")  # fmt: skip
            rows.append(row)
            sys.stderr.write(json.dumps(row) + "\n")
    summary: dict[str, Any] = {"rows": rows, "flush_interval_s": FLUSH_INTERVAL_S}
    for code in ("base", "new"):
        mine = [r for r in rows if r["code"] == code]
        summary[f"knee_lag_{code}"] = knee(mine, "lag_s_p99", FLUSH_INTERVAL_S + GOAL_S)
        summary[f"knee_visible_{code}"] = knee(mine, "post_to_visible_s_p99", GOAL_S)
    (args.out / "ladder.json").write_text(json.dumps(summary, indent=2))
    sys.stdout.write(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
