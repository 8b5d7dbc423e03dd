"""A rank's log capped at DDPQ_RANK_LOG_MAX_BYTES keeps its first and newest bytes with a
marker between them, whatever the sizes of the writes (worker.launchers.local.capped_log)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from worker.launchers.local.capped_log import CappedLog

CAP = 64 * 1024
MARKER_RE = re.compile(rb"\n\xe2\x80\xa6 [\d.]+ MB cut \((\d+) bytes; DDPQ_RANK_LOG_MAX_BYTES=")


def _lines(first: int, count: int) -> bytes:
    return b"".join(b"line %08d\n" % i for i in range(first, first + count))


@pytest.mark.parametrize("chunk_bytes", [7, 4096, 300 * 1024])
def test_a_log_past_its_cap_keeps_the_head_the_newest_bytes_and_says_how_much_was_cut(
    tmp_path: Path, chunk_bytes: int
) -> None:
    data = _lines(0, 25_000)  # 350 kB, 5 × the cap
    log = CappedLog(tmp_path / "rank-0.log", CAP)
    for start in range(0, len(data), chunk_bytes):
        log.write(data[start : start + chunk_bytes])
        assert (tmp_path / "rank-0.log").stat().st_size <= CAP + 200  # never more on disk
    log.close()
    text = (tmp_path / "rank-0.log").read_bytes()
    match = MARKER_RE.search(text)
    assert match is not None, text[CAP // 2 - 50 : CAP // 2 + 200]
    head, tail = text[: match.start()], text[text.index(b"\n", match.end()) + 1 :]
    assert head == data[: CAP // 2]
    assert data.endswith(tail) and len(tail) >= CAP // 4
    cut = int(match.group(1))
    assert cut == len(data) - len(head) - len(tail) == log.cut_bytes
    assert b"MB cut" in text and text.count(b"MB cut") == 1


def test_a_log_within_its_cap_is_every_byte_and_no_write_leaves_no_file(tmp_path: Path) -> None:
    data = _lines(0, 2000)
    log = CappedLog(tmp_path / "rank-0.log", CAP)
    log.write(data[:100])
    log.write(data[100:])
    log.close()
    assert (tmp_path / "rank-0.log").read_bytes() == data
    silent = CappedLog(tmp_path / "rank-1.log", CAP)
    silent.close()
    assert not (tmp_path / "rank-1.log").exists()


def test_a_log_that_cannot_be_written_drops_its_bytes_without_raising(tmp_path: Path) -> None:
    log = CappedLog(tmp_path / "missing-dir" / "rank-0.log", CAP)
    log.write(b"lost\n")  # no directory: logged once, the writer keeps going
    log.write(b"lost too\n")
    log.close()
    assert log.cut_bytes == len(b"lost\n") + len(b"lost too\n"), "every byte dropped counts"


def test_a_name_the_rank_put_there_first_is_never_written_through(tmp_path: Path) -> None:
    """The worker writes the log in a directory the rank user owns: a link planted at the
    log's name must not make it overwrite the link's target."""
    target = tmp_path / "worker-secret"
    target.write_bytes(b"keep me")
    (tmp_path / "rank-0.log").symlink_to(target)
    log = CappedLog(tmp_path / "rank-0.log", CAP)
    log.write(b"hostile bytes\n" * 10)
    log.close()
    assert target.read_bytes() == b"keep me"
    assert log.cut_bytes == 14 * 10, "the refused log's bytes are counted as dropped"
