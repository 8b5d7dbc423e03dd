"""What a command job's rank makes of its script: the exception its traceback names (torch's
``[rankN]:`` prefixes dropped, the last traceback of several), and the script's path as the
spec keeps it (normalised, as typed with shell completion); the line a script killed by a
fatal signal stood at, from the faulthandler dump its rank asks for
(tests/procs/test_script_faults.py makes a real one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.workspaces.command import RunCommandError, check_script
from worker.runtime.script.run import (
    EXITING,
    LAST_LINE_CHARS,
    _failure,
    parse_traceback,
    script_env,
)

TORCH_PREFIXED = """\
some output
[rank1]: Traceback (most recent call last):
[rank1]:   File "/w/boom.py", line 7, in <module>
[rank1]:     raise ValueError("bad batch shape on rank 1")
[rank1]: ValueError: bad batch shape on rank 1
"""

CHAINED = """\
Traceback (most recent call last):
  File "a.py", line 1, in <module>
KeyError: 'x'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "a.py", line 3, in <module>
    raise RuntimeError("while handling")
    ~~~~~~~~~~~~~~~~~~^^^^^^^^^^^^^^^^^^
torch.distributed.DistBackendError: while handling: gloo closed
"""


def test_a_torch_prefixed_traceback_names_the_exception_and_keeps_the_frames() -> None:
    parsed = parse_traceback(TORCH_PREFIXED)
    assert parsed is not None
    assert (parsed.exc_type, parsed.message) == ("ValueError", "bad batch shape on rank 1")
    assert parsed.text.splitlines()[1] == '  File "/w/boom.py", line 7, in <module>'


def test_the_last_traceback_of_a_chain_is_the_one_told() -> None:
    parsed = parse_traceback(CHAINED)
    assert parsed is not None
    assert parsed.exc_type == "torch.distributed.DistBackendError"
    assert parsed.message == "while handling: gloo closed"


@pytest.mark.parametrize("text", ["", "exit 3\n", "Traceback (most recent call last):\n  x\n"])
def test_no_traceback_is_none(text: str) -> None:
    assert parse_traceback(text) is None


def test_a_script_typed_with_a_leading_dot_slash_is_kept_normalised(tmp_path: Path) -> None:
    assert check_script(["./train.py", "--lr", "1"], {"train.py"}, tmp_path) == [
        "train.py", "--lr", "1",
    ]  # fmt: skip
    assert check_script(["src/./t.py"], {"src/t.py"}, tmp_path) == ["src/t.py"]
    with pytest.raises(RunCommandError, match="not among the files shipped"):
        check_script(["../train.py"], {"train.py"}, tmp_path)


def test_an_exit_without_a_traceback_quotes_the_scripts_last_stderr_line() -> None:
    # What argparse prints for a flag the script does not know: the job's error must say it,
    # not only the exit code (else the cause is only in the rank's log).
    usage = "usage: train.py [-h] [--steps STEPS]\ntrain.py: error: unrecognized arguments: -x\n\n"
    err = _failure(2, usage)
    assert err.exc_type == "ScriptExit"
    assert err.message == (
        "the script exited with code 2 without a Python traceback; its last line on stderr: "
        "train.py: error: unrecognized arguments: -x"
    )
    assert err.traceback_text == usage.rstrip()


def test_an_exit_without_output_says_only_how_it_ended_and_a_long_line_is_cut() -> None:
    assert _failure(-9, "").message == "the script was killed by SIGKILL without a Python traceback"
    said = _failure(1, "x" * 1000).message.split("stderr: ", 1)[1]
    assert len(said) == LAST_LINE_CHARS and said.endswith("…")


def test_a_fault_in_a_thread_without_python_frames_names_no_line() -> None:
    dump = (
        "Fatal Python error: Aborted\n\nThread 0x01 (most recent call first):\n"
        '  File "/w/train.py", line 9 in main\n\n'
        "Current thread 0x02 (most recent call first):\n  <no Python frame>\n"
    )
    err = _failure(-6, "boom\n" + dump)
    assert err.message == (
        "the script was killed by SIGABRT without a Python traceback; its last line on stderr: boom"
    )


def test_the_script_gets_a_faulthandler_unless_it_chose_otherwise() -> None:
    assert script_env({"PATH": "/bin"}) == {"PATH": "/bin", "PYTHONFAULTHANDLER": "1"}
    assert script_env({"PYTHONFAULTHANDLER": ""})["PYTHONFAULTHANDLER"] == ""


def test_a_fault_while_python_exits_says_no_python_code_ran() -> None:
    # What a rank of the unchanged tutorial script printed when torch's gloo aborted it as
    # Python exited (a C++ thread got the signal; the main thread had no frame left).
    output = (
        "epoch 0 loss 14.7894\nterminate called without an active exception\n"
        "Fatal Python error: Aborted\n\nThread 0x00007fe2dbddab80 (most recent call first):\n"
        "  <no Python frame>\n\nExtension modules: numpy._core._multiarray_umath, torch._C "
        "(total: 2)\n"
    )
    err = _failure(-6, output)
    assert err.message == (
        f"the script was killed by SIGABRT {EXITING} without a Python traceback; its last "
        "line on stderr: terminate called without an active exception"
    )
    assert err.traceback_text.endswith("<no Python frame>")
