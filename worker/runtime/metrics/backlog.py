"""Rank 0's metric backlog: points handed to the writer but not yet accepted by the attempt API,
and their encodings (the spill file's lines, the attempt API's rows and columns).

A FIFO, oldest first. At most ``memory_cap`` points stay in memory; past that, newer points
are appended to a spill file (JSON lines, ``service.core.artifacts.metrics_spill_path``) and read
back in order as the writer catches up, so a long API outage costs disk, not memory,
and loses nothing. The training thread appends (a list extend; a file append only while
spilling); the writer thread peeks at the oldest points, writes them, then drops them. One
lock guards both sides and is never held across a request.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from datetime import datetime
from itertools import islice
from pathlib import Path
from typing import IO, TYPE_CHECKING

from service.core.metrics.points import CheckedPoint, MetricPoint, checked_point
from service.core.wire.attempt import MetricBatch, MetricSeries, encode_value

if TYPE_CHECKING:  # the buffer imports torch; the backlog needs only the type
    from worker.runtime.metrics.buffer import Progress

log = logging.getLogger(__name__)


def encode_point(point: MetricPoint) -> bytes:
    """One spill-file line (NaN and ±inf as JSON's ``NaN``/``Infinity`` extensions)."""
    record = {
        "name": point.name,
        "step": point.step,
        "value": point.value,
        "epoch": point.epoch,
        "time": point.time.isoformat() if point.time is not None else None,
        "ranks": point.ranks,
    }
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"


def decode_point(line: bytes) -> CheckedPoint:
    """Inverse of ``encode_point``, checked again (``checked_point``): a file is a boundary.

    Raises:
        ValueError: not a line ``encode_point`` wrote (bad JSON, missing fields, or a point
            ``checked_point`` refuses).
    """
    try:
        record = json.loads(line)
        time = record["time"]
        point = MetricPoint(
            name=str(record["name"]),
            step=int(record["step"]),
            value=float(record["value"]),
            epoch=None if record["epoch"] is None else int(record["epoch"]),
            time=datetime.fromisoformat(time) if time is not None else None,
            ranks=None if record.get("ranks") is None else int(record["ranks"]),
        )
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a spilled metric point: {line[:80]!r}") from exc
    return checked_point(point)


class MetricBacklog:
    """Points waiting for the attempt API, oldest first: memory up to ``memory_cap``, then a file.

    Invariant: every point in the file is newer than every point in memory, so reading the
    file back after the memory drains keeps the order. Thread-safe.

    Args:
        spill_path: the spill file; created on first spill, removed once read back.
        memory_cap: points held in memory before newer ones go to the file (≥ 1).
    """

    def __init__(self, spill_path: Path, memory_cap: int) -> None:
        self.spill_path = spill_path
        self.memory_cap = max(1, memory_cap)
        self._lock = threading.Lock()
        self._memory: deque[CheckedPoint] = deque()
        self._in_file = 0  # points in the file not read back yet
        self._read_offset = 0  # bytes of the file read back so far
        self._file: IO[bytes] | None = None  # append handle while the file exists
        self.spilled_total = 0  # points ever written to the file
        self._spill_broken = False

    def __len__(self) -> int:
        with self._lock:
            return len(self._memory) + self._in_file

    @property
    def in_file(self) -> int:
        """Points currently waiting in the spill file."""
        with self._lock:
            return self._in_file

    def append(self, points: Sequence[CheckedPoint]) -> None:
        """Add ``points`` (newest last). Never raises for a full disk: the points then stay in
        memory past the cap (logged once), because losing them is worse than the memory."""
        if not points:
            return
        with self._lock:
            room = 0 if self._in_file else max(0, self.memory_cap - len(self._memory))
            self._memory.extend(points[:room])
            rest = points[room:]
            if rest and not self._spill(rest):
                self._memory.extend(rest)  # out of order only in this failure case

    def peek(self, limit: int) -> list[CheckedPoint]:
        """Up to ``limit`` of the oldest points (they stay until ``drop_oldest``); fewer when
        the memory cap is smaller than ``limit``."""
        with self._lock:
            if len(self._memory) < limit and self._in_file:
                try:
                    self._read_back(self.memory_cap - len(self._memory))
                except OSError as exc:
                    log.error("cannot read back %s (%s): %d points lost",
                              self.spill_path, exc, self._in_file)  # fmt: skip
                    self._in_file = 0
                    self._remove_file()
            return list(islice(self._memory, limit))

    def drop_oldest(self, count: int) -> None:
        """Forget the ``count`` oldest points (written; call only with what ``peek`` gave)."""
        with self._lock:
            for _ in range(min(count, len(self._memory))):
                self._memory.popleft()

    def replace_oldest(self, count: int, points: Sequence[CheckedPoint]) -> None:
        """Put ``points`` (a subset of them, oldest first) in place of the ``count`` oldest
        (call only with what ``peek`` gave): they are sent next."""
        with self._lock:
            for _ in range(min(count, len(self._memory))):
                self._memory.popleft()
            self._memory.extendleft(reversed(points))

    def discard(self) -> int:
        """Forget everything (the attempt was fenced off); returns how many points."""
        with self._lock:
            count = len(self._memory) + self._in_file
            self._memory.clear()
            self._in_file = 0
            self._remove_file()
            return count

    def persist(self) -> int:
        """Write every point still waiting into the spill file, oldest first (atomically:
        temp file, fsync, rename), so nothing is lost when the writer gives up. Returns how
        many points the file holds (0: nothing waits, no file is left).

        Raises:
            OSError: the file could not be written.
        """
        with self._lock:
            count = len(self._memory) + self._in_file
            if not count:
                self._remove_file()
                return 0
            tail = b""
            if self._in_file:
                with open(self.spill_path, "rb") as f:
                    f.seek(self._read_offset)
                    tail = f.read()
            self._close_file()
            tmp = self.spill_path.with_name(self.spill_path.name + ".tmp")
            self.spill_path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(b"".join(encode_point(p) for p in self._memory) + tail)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.spill_path)
            # The file now holds every waiting point: account for it so that ``close`` keeps
            # it (it removed the file when the points had only been in memory).
            self._memory.clear()
            self._in_file, self._read_offset = count, 0
            return count

    def close(self) -> None:
        """Close the file handle; the file stays only if it holds unsent points."""
        with self._lock:
            if self._in_file:
                self._close_file()
            else:
                self._remove_file()

    # -- under the lock -------------------------------------------------------------------------
    def _spill(self, points: Sequence[CheckedPoint]) -> bool:
        if self._spill_broken:
            return False
        size = 0
        try:
            if self._file is None:
                self.spill_path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.spill_path, "ab")  # noqa: SIM115 - kept open while used
            size = self._file.tell()
            self._file.write(b"".join(encode_point(p) for p in points))
            self._file.flush()
        except OSError as exc:
            log.error(
                "cannot spill metric points to %s (%s): keeping them in memory past the cap",
                self.spill_path,
                exc,
            )
            self._spill_broken = True
            if self._file is not None:  # drop a partly written line
                with contextlib.suppress(OSError):
                    self._file.truncate(size)
            return False
        self._in_file += len(points)
        self.spilled_total += len(points)
        return True

    def _read_back(self, limit: int) -> None:
        with open(self.spill_path, "rb") as f:
            f.seek(self._read_offset)
            while self._in_file and limit > 0:
                line = f.readline()
                if not line.endswith(b"\n"):  # end of file: the count is off; trust the file
                    log.error("spill file %s ended early; %d points missing", self.spill_path,
                              self._in_file)  # fmt: skip
                    self._in_file = 0
                    break
                self._in_file -= 1
                limit -= 1
                try:
                    self._memory.append(decode_point(line))
                except ValueError as exc:
                    log.error("skipping a line of %s: %s", self.spill_path, exc)
            self._read_offset = f.tell()
        if not self._in_file:
            self._remove_file()

    def _close_file(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None

    def _remove_file(self) -> None:
        self._close_file()
        self._read_offset = 0
        with contextlib.suppress(FileNotFoundError):
            self.spill_path.unlink()


def metric_series(points: Sequence[MetricPoint]) -> list[MetricSeries]:
    """``points`` as the wire's columns: one ``MetricSeries`` per (name, ranks), in the
    order each first appears, each point in its series in the order given (times in epoch
    seconds; a point without a time is stamped now)."""
    now = time.time()
    by_key: dict[tuple[str, int | None], MetricSeries] = {}
    for p in points:
        key = (p.name, p.ranks)
        s = by_key.get(key)
        if s is None:
            s = by_key[key] = MetricSeries.model_construct(
                name=p.name, steps=[], values=[], times_s=[], epochs=[], ranks=p.ranks
            )
        s.steps.append(p.step)
        s.values.append(encode_value(p.value))
        s.times_s.append(p.time.timestamp() if p.time is not None else now)
        s.epochs.append(p.epoch)  # type: ignore[union-attr]  # built as a list above
    return list(by_key.values())


def metric_batch(points: list[CheckedPoint], progress: Progress | None) -> MetricBatch:
    """The request body for ``points`` (already checked: no second validation pass, which
    would cost more than the request) and the progress snapshot, in columns."""
    return MetricBatch.model_construct(
        series=metric_series(points),
        progress=progress.as_dict() if progress is not None else None,
    )
