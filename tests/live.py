"""Serving an app over real loopback HTTP for tests that need a live server (CLI, client,
browser): one place instead of a copy per test module."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn


@contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """``app`` under uvicorn in a daemon thread on a free loopback port until the block ends.

    Yields:
        The base URL, ``http://127.0.0.1:PORT``.
    Raises:
        RuntimeError: the server did not start within 30 s (its log says why).
    """
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound before the server starts: no race for the port
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start within 30 s (see the log above)")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
