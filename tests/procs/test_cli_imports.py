"""The control plane's entry points load without the worker: ``ddpq submit`` and the API do
not pay for (or need) torch and the launchers; ``ddpq worker`` / ``ddpq up`` import them lazily."""

from __future__ import annotations

import subprocess
import sys


def test_service_does_not_import_worker_at_module_level() -> None:
    code = (
        "import sys, service.cli.main, service.app, service.client\n"
        "bad = [m for m in sys.modules if m == 'worker' or m.startswith('worker.')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
