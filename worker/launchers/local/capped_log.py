"""A log file capped at a number of bytes that keeps its first part and its newest part, with
a marker line between them saying how much was cut (what journald and Kubernetes do).

The layout of a capped file::

    <the first cap/2 bytes written>
    … 12.3 MB cut (12345678 bytes; DDPQ_RANK_LOG_MAX_BYTES=67108864 keeps the first and
    newest parts) …                                         (one line)
    <the newest bytes written, at least cap/4 of them>

Until the first cut the file is plainly every byte written. Once the file would pass the cap,
the newest ``cap/4`` bytes are moved down behind the head and the marker (one copy of at most
``cap/4`` bytes per ``cap/4`` bytes written: each byte is written at most twice), so the file
never holds more than ``cap`` bytes plus the marker line, and a writer is never made to wait
for anything but its own bytes reaching the page cache.

A reader following the file by byte offset (``ddpq logs -f``) keeps its place in the head;
past it, a cut moves the newest bytes to lower offsets, and the reader resumes from where its
offset now falls: what was cut is gone for it too.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

SETTING = "DDPQ_RANK_LOG_MAX_BYTES"
# Bytes moved per copy while compacting the tail (bounded memory, whatever the cap).
COPY_CHUNK_BYTES = 1024 * 1024


def cut_marker(cut_bytes: int, cap_bytes: int) -> bytes:
    """The line between the kept head and the kept tail: ``… N MB cut (…) …`` (MB = 10^6
    bytes), with the exact count and the setting to raise."""
    return (
        f"\n… {cut_bytes / 1e6:.1f} MB cut ({cut_bytes} bytes; {SETTING}={cap_bytes} keeps the "
        "first and newest parts) …\n"
    ).encode()


class CappedLog:
    """One log file written through ``write``, never holding more than about ``cap_bytes``
    (see the module docstring). Created (truncated, mode 0644) at the first write, so a rank
    that writes nothing leaves no file. A symbolic link at ``path`` is never followed: the
    log is then dropped, as on a full disk.

    Errors writing the file (a full disk) are logged once; the bytes are then dropped, the
    caller is never blocked nor raised at: its producer must keep running.
    """

    def __init__(self, path: Path, cap_bytes: int) -> None:
        """Args:
        path: the log file.
        cap_bytes: its most bytes (the marker line aside); at least 4096.
        Raises:
            ValueError: ``cap_bytes`` is below 4096.
        """
        if cap_bytes < 4096:
            raise ValueError(f"a capped log needs at least 4096 bytes, got {cap_bytes}")
        self.path = path
        self.cap_bytes = cap_bytes
        self.head_bytes = cap_bytes // 2
        self.keep_bytes = cap_bytes // 4
        self.size = 0  # bytes in the file now
        self.tail_start = self.head_bytes  # where the tail's bytes begin (after the marker)
        self.cut_bytes = 0  # bytes written to us and dropped
        self._fd: int | None = None
        self._broken = False

    def write(self, data: bytes) -> None:
        """Append ``data`` (any length), cutting the middle when the file would pass the cap."""
        if not data or self._broken:
            self.cut_bytes += len(data) if self._broken else 0
            return
        try:
            self._write(data)
        except OSError as exc:
            self._broken = True
            self.cut_bytes += len(data)  # at most this much; a partial write is rare
            log.error("%s: cannot write the log (%s); its further output is dropped",
                      self.path, exc)  # fmt: skip

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _open(self) -> int:
        if self._fd is None:
            # O_NOFOLLOW: never through a link the rank user put at the log's name (the
            # worker would truncate the link's target and fill it with the rank's bytes);
            # such a log is refused (OSError: logged once, its bytes dropped).
            flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
            self._fd = os.open(self.path, flags, 0o644)
        return self._fd

    def _write(self, data: bytes) -> None:
        fd = self._open()
        if self.size < self.head_bytes:
            head = data[: self.head_bytes - self.size]
            _pwrite_all(fd, head, self.size)
            self.size += len(head)
            data = data[len(head) :]
            if not data:
                return
        if len(data) >= self.keep_bytes:
            # Everything in the tail so far, and the front of data, is older than what stays.
            self.cut_bytes += (self.size - self.tail_start) + (len(data) - self.keep_bytes)
            self._rewrite_tail(fd, data[-self.keep_bytes :])
            return
        _pwrite_all(fd, data, self.size)
        self.size += len(data)
        if self.size > self.cap_bytes:
            self._compact(fd)

    def _rewrite_tail(self, fd: int, newest: bytes) -> None:
        marker = cut_marker(self.cut_bytes, self.cap_bytes)
        _pwrite_all(fd, marker + newest, self.head_bytes)
        self.tail_start = self.head_bytes + len(marker)
        self.size = self.tail_start + len(newest)
        os.ftruncate(fd, self.size)

    def _compact(self, fd: int) -> None:
        """Keep the newest ``keep_bytes`` of the tail, moved down behind the head and a new
        marker; the rest of the tail is cut."""
        src = self.size - self.keep_bytes
        self.cut_bytes += src - self.tail_start
        marker = cut_marker(self.cut_bytes, self.cap_bytes)
        dest = self.head_bytes + len(marker)
        # dest < src (cap/2 + a line < 3·cap/4): a forward copy in ascending chunks is safe.
        moved = 0
        while moved < self.keep_bytes:
            chunk = os.pread(fd, min(COPY_CHUNK_BYTES, self.keep_bytes - moved), src + moved)
            if not chunk:
                break
            _pwrite_all(fd, chunk, dest + moved)
            moved += len(chunk)
        _pwrite_all(fd, marker, self.head_bytes)
        self.tail_start = dest
        self.size = dest + moved
        os.ftruncate(fd, self.size)


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written
