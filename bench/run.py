"""Run the benchmark set (each in its own process), print a ratio table and write one JSON file.

``python -m bench.run [--size tiny|default|full] [--only reporting,claims] [--out FILE]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# In the order of the task's priorities: #1, #4, #6, #3, #2, #5, then #7, #8, the sweeps', #9,
# #10 and #11, then the hostile owner's, then the charts of long runs and big sweeps.
BENCHMARKS = (
    "reporting",
    "claims",
    "ingest",
    "launch",
    "checkpoint",
    "api",
    "scale",
    "checkpoint_upload",
    "sweeps",
    "sweep_page",
    "workspace",
    "followed",
    "worker_api",
    "hostile",
    "rollups",
    "sweep_trials",
)
DEFAULT_MLFLOW_SITE = "/tmp/mlflow-site"


def run_one(name: str, size: str, timeout_s: float) -> dict[str, Any]:
    """Run ``python -m bench.<name> --size <size>`` and return its result dict (or an error)."""
    with tempfile.TemporaryDirectory(prefix="ddpq-bench-") as tmp:
        out = Path(tmp) / f"{name}.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if "DDPQ_BENCH_MLFLOW_SITE" not in env and Path(DEFAULT_MLFLOW_SITE).is_dir():
            env["DDPQ_BENCH_MLFLOW_SITE"] = DEFAULT_MLFLOW_SITE
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", f"bench.{name}", "--size", size, "--json", str(out)],
                env=env, capture_output=True, text=True, timeout=timeout_s,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"name": name, "size": size, "error": f"timed out after {timeout_s:.0f} s"}
        elapsed_s = round(time.perf_counter() - t0, 1)
        if proc.returncode != 0 or not out.exists():
            return {"name": name, "size": size, "error": proc.stderr[-3000:], "wall_s": elapsed_s}
        result: dict[str, Any] = json.loads(out.read_text())
        result["wall_s"] = elapsed_s
        return result


def format_table(results: list[dict[str, Any]]) -> str:
    """One line per ratio and per goal: ``benchmark  key  value``."""
    lines = [f"{'benchmark':<11} {'ratio / goal':<34} value"]
    for res in results:
        if "error" in res:
            lines.append(f"{res['name']:<11} {'ERROR':<34} {res['error'].splitlines()[-1:]}")
            continue
        for key, value in res["ratios"].items():
            shown = "not measured" if value is None else f"{value:.3f}"
            lines.append(f"{res['name']:<11} {key:<34} {shown}")
        for key, met in res["goals"].items():
            shown = "not measured" if met is None else ("met" if met else "MISSED")
            lines.append(f"{res['name']:<11} {'goal ' + key:<34} {shown}")
    return "\n".join(lines)


def main() -> None:
    """CLI entry point."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size", choices=("tiny", "default", "full"), default="default")
    p.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated subset")
    p.add_argument("--out", type=Path, default=Path("bench-results.json"))
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per benchmark (seconds)")
    args = p.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - set(BENCHMARKS)
    if unknown:
        p.error(f"unknown benchmark(s) {sorted(unknown)}; choose from {', '.join(BENCHMARKS)}")
    results = []
    for name in names:
        sys.stderr.write(f"running {name} ({args.size})…\n")
        results.append(run_one(name, args.size, args.timeout_s))
        doc = {
            "size": args.size,
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0],
            "results": results,
        }
        args.out.write_text(json.dumps(doc, indent=2))  # after each one: partial runs count
    sys.stdout.write(format_table(results) + f"\n\nwritten to {args.out}\n")


if __name__ == "__main__":
    main()
