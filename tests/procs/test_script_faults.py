"""A user's script killed by a fatal signal, as its rank runs it: Python's faulthandler dump
(which the rank's ``script_env`` turns on) names the script's line in the job's error, and
the library's own last words on stderr are still quoted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from worker.runtime.script.run import _failure, script_env


def test_a_script_killed_by_a_fatal_signal_names_its_line_and_the_librarys_last_words(
    tmp_path: Path,
) -> None:
    # What a C++ library's abort looks like from the script (gloo's std::terminate at exit):
    # its last words on stderr, then SIGABRT. With the faulthandler the rank turns on, the
    # job's error names the script's line and still quotes those words.
    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys, threading, time\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "def main():\n"
        "    sys.stderr.write('terminate called without an active exception\\n')\n"
        "    sys.stderr.flush()\n"
        "    os.abort()\n"
        "main()\n"
    )
    env = script_env(os.environ)
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == -signal.SIGABRT
    err = _failure(done.returncode, done.stderr)
    assert err.message == (
        "the script was killed by SIGABRT at train.py:6 in main without a Python traceback; "
        "its last line on stderr: terminate called without an active exception"
    )
    assert err.traceback_text.startswith("Fatal Python error: Aborted")
    assert 'train.py", line 6 in main' in err.traceback_text
    assert "Extension modules" not in err.traceback_text
