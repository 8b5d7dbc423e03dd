"""The API's CPU per metric batch, in one process: the app (``create_app``) called as ASGI
with ready request bodies, no HTTP client or server in the way, so the CPU counted
(``time.process_time``, every thread of the process) is the app's own: routing, the token
dependency, parsing, the checks, the statement and the ack. ``--profile FILE`` writes a
cProfile of the same calls. Runs against the code on ``sys.path``: with ``PYTHONPATH`` set to
another checkout it measures that one (the body format follows what its wire module offers,
``--format``).

Run: ``python -m bench.ingest_cpu --jobs 200 --batches 2000 --points 20``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:  # as uvicorn runs the app where it can
    import uvloop
except ImportError:  # pragma: no cover - Windows, other Pythons
    uvloop = None  # type: ignore[assignment]

from bench import common
from service.app import create_app
from service.core.config import Settings
from service.core.wire import API_PREFIX
from service.core.wire import attempt as wire

Message = dict[str, Any]


def rows_body(step0: int, points: int, t0: float) -> bytes:
    """A batch in the row format: ``points`` steps of ``loss`` from ``step0``."""
    rows = [["loss", s, 0, 0.5, t0 + s / 10] for s in range(step0, step0 + points)]
    return json.dumps({"points": rows}).encode()


def columns_body(step0: int, points: int, t0: float) -> bytes:
    """The same batch in the columnar format (one series of ``loss``)."""
    steps = list(range(step0, step0 + points))
    series = {"name": "loss", "steps": steps, "epochs": [0] * points,
              "values": [0.5] * points, "times_s": [t0 + s / 10 for s in steps]}  # fmt: skip
    return json.dumps({"series": [series]}).encode()


async def post(app: Any, token: str, body: bytes) -> int:
    """One ``POST`` of ``body`` to the metrics route as an ASGI call; the status."""
    scope: Message = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": f"{API_PREFIX}{wire.METRICS_PATH}", "raw_path": b"",
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": None,
        "headers": [(b"host", b"bench"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"authorization", f"Bearer {token}".encode())],
    }  # fmt: skip
    sent = False
    status = 0

    async def receive() -> Message:
        nonlocal sent
        if sent:
            await asyncio.sleep(3600)
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])

    await app(scope, receive, send)
    return status


async def drive(app: Any, bodies: list[tuple[str, bytes]], concurrency: int) -> list[int]:
    """Every body posted, ``concurrency`` at a time; their statuses."""
    free = asyncio.Semaphore(concurrency)

    async def one(token: str, body: bytes) -> int:
        async with free:
            return await post(app, token, body)

    return list(await asyncio.gather(*(one(t, b) for t, b in bodies)))


def main() -> None:
    """CLI: see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--batches", type=int, default=2000, help="timed batches")
    p.add_argument("--points", type=int, default=20, help="points per batch")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--format", choices=("auto", "rows", "columns"), default="auto")
    p.add_argument("--profile", type=Path, default=None, help="write a cProfile here")
    args = p.parse_args()
    fmt = args.format
    if fmt == "auto":
        fmt = "columns" if "series" in wire.MetricBatch.model_fields else "rows"
    make = columns_body if fmt == "columns" else rows_body
    t0 = time.time() - 3600
    with common.pg_schema() as url, tempfile.TemporaryDirectory() as tmp:
        db = common.migrated(url)
        tokens = common.running_jobs(db, args.jobs)
        settings = Settings(home=Path(tmp) / ".ddpq", database_url=url,
                            artifact_dir=Path(tmp) / "artifacts")  # fmt: skip
        app = create_app(settings)
        jobs = sorted(tokens)
        step = dict.fromkeys(jobs, 1)

        def bodies(n: int) -> list[tuple[str, bytes]]:
            out = []
            for i in range(n):
                job = jobs[i % len(jobs)]
                out.append((tokens[job], make(step[job], args.points, t0)))
                step[job] += args.points
            return out

        async def run_all() -> dict[str, Any]:
            warm = await drive(app, bodies(len(jobs)), args.concurrency)  # tokens cached
            timed = bodies(args.batches)
            prof = cProfile.Profile() if args.profile else None
            c0, w0 = time.process_time(), time.perf_counter()
            if prof is not None:
                prof.enable()
            statuses = await drive(app, timed, args.concurrency)
            if prof is not None:
                prof.disable()
                prof.dump_stats(str(args.profile))
            cpu_s, wall_s = time.process_time() - c0, time.perf_counter() - w0
            bad = [s for s in warm + statuses if s != 200]
            n = args.batches * args.points
            return {
                "format": fmt, "code": str(Path(wire.__file__).parents[3]),
                "batches": args.batches, "points_per_batch": args.points,
                "not_200": len(bad), "cpu_s": round(cpu_s, 3), "wall_s": round(wall_s, 3),
                "cpu_ms_per_batch": round(1000 * cpu_s / args.batches, 3),
                "cpu_s_per_1k_points": round(1000 * cpu_s / n, 4),
            }  # fmt: skip

        async def in_lifespan() -> dict[str, Any]:
            # As a server runs the app: its start-up opens what the routes use (the
            # event loop's own database connections on PostgreSQL).
            lifespan = getattr(app.router, "lifespan_context", None)
            if lifespan is None:
                return await run_all()
            async with lifespan(app):
                return await run_all()

        result = uvloop.run(in_lifespan()) if uvloop is not None else asyncio.run(in_lifespan())
        app.state.db.dispose()
        db.dispose()
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
