"""What a command job's rank makes of its script: the exception its traceback names (torch's
``[rankN]:`` prefixes dropped, the last traceback of several), and the script's path as the
spec keeps it (normalised, as typed with shell completion)."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.workspaces.command import RunCommandError, check_script
from worker.runtime.script.run import parse_traceback

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
