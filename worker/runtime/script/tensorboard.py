"""The TensorBoard scalars a command job's script writes under ``metrics.tensorboard``, read as
its event files grow, with TensorBoard's own reader.

Rank 0's side polls ``TensorBoardScalars`` about once a second. Each event file under the
log directory (recursively, as they appear) gets one ``EventFileLoader``, whose ``Load()``
continues where the previous call stopped. A record still being written at a file's end is
not lost: TensorBoard's reader stops before it, keeps the bytes it read, and reads the whole
record on a later call. Without TensorFlow, TensorBoard's stub reader does this
(``PyRecordReader_New`` buffers the partial record; ``Load()`` swallows the ``DataLossError``);
with TensorFlow, its ``tf_record_iterator`` resumes the same way.

TensorBoard's reader cannot tell a damaged record (a failed checksum) from one being written:
it stops there and tries again on each call, so the file's later records are never reached.
A file that grew on ``STUCK_GROWTHS`` polls since its last record with none coming out is
logged once as damaged (writers append whole records, so growth completes a partial one; a
record dribbled out over several polls would be reported too, and still read once whole). A
file whose reader raises (a record that is no event, the file gone) is logged once and no
longer read; the records before it count. A file that is no record from its first byte and
never grows looks like a first record being written: it yields nothing, unreported.
``poll`` never raises.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.core.errors import DdpqError
from worker.attempt import FailureReason

log = logging.getLogger(__name__)

# Polls on which an event file grew while its reader returned no record: then it is damaged.
STUCK_GROWTHS = 3
# The plugin of a scalar summary (tensorboard.plugins.scalar.metadata.PLUGIN_NAME).
SCALARS_PLUGIN = "scalars"


@dataclass(frozen=True)
class Scalar:
    """One scalar point of an event file.

    ``name`` is the summary's tag (``metric_name``): the directories the event files lie in
    are runs of the one job, not part of the name, except the one ``add_scalars`` writes per
    key (``losses_train/`` holding tag ``losses`` is ``losses/train``). ``step`` is the
    ``global_step`` as written (0 when none was given); ddpq's steps start at 1, so the
    caller drops steps < 1. ``value`` is as stored (torch stores float32: 0.1 reads
    0.10000000149), NaN and ±inf included. ``wall_time`` is the event's time in seconds since
    the epoch.
    """

    name: str
    step: int
    value: float
    wall_time: float


class TensorBoardUnavailableError(DdpqError):
    """TensorBoard cannot be imported on this worker host, so ``metrics.tensorboard`` cannot be
    read: ``pip install tensorboard`` (or ``ddpq[tensorboard]``) there. A setup failure."""

    status_code = 500
    code = "tensorboard_unavailable"
    reason = FailureReason.SETUP


def _tensorboard() -> tuple[Any, Any]:
    """TensorBoard's ``EventFileLoader`` class and ``make_ndarray``, imported now.

    Raises:
        TensorBoardUnavailableError: tensorboard (or its protobuf) does not import.
    """
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
        from tensorboard.util.tensor_util import make_ndarray
    except Exception as exc:  # ImportError, or a protobuf that does not match (TypeError)
        raise TensorBoardUnavailableError(
            f"tensorboard does not import on this worker host ({type(exc).__name__}: {exc}): "
            "run `pip install tensorboard` there to read a job's metrics.tensorboard"
        ) from exc
    return EventFileLoader, make_ndarray


def tensorboard_available() -> bool:
    """Whether TensorBoard's event-file reader imports here (it is an optional extra)."""
    try:
        _tensorboard()
    except TensorBoardUnavailableError:
        return False
    return True


@dataclass
class _EventFile:
    """What ``TensorBoardScalars`` keeps per event file."""

    loader: Any  # EventFileLoader; None once the file failed
    subdir: str  # the name of the directory the file lies in ("" for the log directory)
    scalar_tags: dict[str, bool] = field(default_factory=dict)  # tag -> is a scalar
    size_bytes: int = 0  # the file's size at the previous poll
    stuck_growths: int = 0  # polls since the last record on which the file grew
    stuck_logged: bool = False


class TensorBoardScalars:
    """The scalars of every event file under one log directory, as they are written."""

    def __init__(self, logdir: Path, within: Path | None = None) -> None:
        """Follow ``logdir``, which need not exist yet (the script creates it later).

        Args:
            within: a directory ``logdir`` must stay inside (the workspace): while the log
                directory resolves elsewhere (a symbolic link out), nothing is read.
        Raises:
            TensorBoardUnavailableError: tensorboard is not installed on this host.
        """
        self._logdir, self._within = logdir, within
        self._warned_outside = False
        self._loader_class, self._make_ndarray = _tensorboard()
        self._files: dict[Path, _EventFile] = {}

    def poll(self) -> list[Scalar]:
        """The scalars written since the previous poll, from every event file under the log
        directory (recursively; new files as they appear): file by file (a directory's files
        by name, then its subdirectories by name), each file's in the order written.

        Never raises: a damaged or unreadable file is logged once (module docstring).
        """
        scalars: list[Scalar] = []
        for path, subdir in self._event_files():
            followed = self._files.get(path)
            if followed is None:
                followed = self._files[path] = self._open(path, subdir)
            if followed.loader is not None:
                scalars.extend(self._read(path, followed))
        return scalars

    def _event_files(self) -> list[tuple[Path, str]]:
        """Each event file under the log directory, with its directory's name, in poll's
        order."""
        found: list[tuple[Path, str]] = []
        if self._within is not None and not self._inside():
            return found
        # os.walk yields nothing for a missing directory and follows no symlinked directory.
        for dirpath, dirnames, filenames in os.walk(self._logdir):
            dirnames.sort()
            subdir = "" if Path(dirpath) == self._logdir else Path(dirpath).name
            # TensorBoard's own test (io_wrapper.IsTensorFlowEventsFile): "tfevents" in the name.
            found.extend(
                (Path(dirpath, n), subdir)
                for n in sorted(filenames)
                if "tfevents" in n and _regular(Path(dirpath, n))
            )
        return found

    def _inside(self) -> bool:
        """Whether the log directory resolves inside ``within`` (said once when not)."""
        assert self._within is not None
        real = os.path.realpath(self._logdir)
        if Path(real).is_relative_to(os.path.realpath(self._within)):
            return True
        if not self._warned_outside:
            self._warned_outside = True
            log.warning("tensorboard: %s leads out of %s (%s): not read", self._logdir,
                        self._within, real)  # fmt: skip
        return False

    def _open(self, path: Path, subdir: str) -> _EventFile:
        try:
            return _EventFile(self._loader_class(str(path)), subdir)
        except Exception as exc:  # e.g. the file went away since it was listed
            _log_failed(path, exc)
            return _EventFile(None, subdir)

    def _read(self, path: Path, followed: _EventFile) -> list[Scalar]:
        """The new scalars of one file; marks it failed when its reader raises."""
        try:
            size_bytes = path.stat().st_size  # before reading: growth the reader could see
        except OSError:
            size_bytes = followed.size_bytes
        scalars: list[Scalar] = []
        events = 0
        try:
            for event in followed.loader.Load():
                events += 1
                scalars.extend(self._scalars_of(event, followed))
        except Exception as exc:  # the records read before it stay read
            _log_failed(path, exc)
            followed.loader = None
            return scalars
        if events:
            followed.stuck_growths = 0
        elif size_bytes > followed.size_bytes:
            followed.stuck_growths += 1
            if followed.stuck_growths >= STUCK_GROWTHS and not followed.stuck_logged:
                followed.stuck_logged = True
                log.warning(
                    "tensorboard: %s grew but no new record of it could be read on %d polls: "
                    "a damaged record stops TensorBoard's reader; the later ones are skipped",
                    path,
                    followed.stuck_growths,
                )
        followed.size_bytes = size_bytes
        return scalars

    def _scalars_of(self, event: Any, followed: _EventFile) -> list[Scalar]:
        """The scalar values of one event (an ``event_pb2.Event``); others are ignored."""
        scalars: list[Scalar] = []
        for value in event.summary.value:
            number = self._number_of(value, followed)
            if number is not None:
                name = metric_name(followed.subdir, value.tag)
                scalars.append(Scalar(name, int(event.step), number, event.wall_time))
        return scalars

    def _number_of(self, value: Any, followed: _EventFile) -> float | None:
        """A ``Summary.Value``'s number when it is a scalar: a one-element tensor of the
        "scalars" plugin. Both encodings arrive so: the loader's ``data_compat`` turns the old
        ``simple_value`` (torch's SummaryWriter) into that form, with the plugin on every value;
        TF2 and ``tensorboard.summary`` write it themselves, with the plugin on a tag's first
        value only (so each file's tags are remembered)."""
        plugin = value.metadata.plugin_data.plugin_name
        if plugin:
            followed.scalar_tags[value.tag] = plugin == SCALARS_PLUGIN
        if value.WhichOneof("value") != "tensor" or not followed.scalar_tags.get(value.tag):
            return None
        try:
            array = self._make_ndarray(value.tensor)
            if array.size != 1 or array.dtype.kind not in "biuf":
                return None
            return float(array.reshape(()))
        except (TypeError, ValueError) as exc:  # a tensor proto that does not decode
            log.debug("tensorboard: tag %s: no scalar in its tensor (%s)", value.tag, exc)
            return None


def _regular(path: Path) -> bool:
    """A regular file itself, not a symbolic link, fifo or device (opening a fifo would
    block the reader; a link may lead out of the workspace)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def metric_name(subdir: str, tag: str) -> str:
    """The metric a scalar of ``tag`` in an event file of directory ``subdir`` becomes.

    The directories under the followed log directory are runs (``SummaryWriter()`` makes
    ``runs/<date>_<host>/``, a new one per attempt): one job's runs share its metric names, so
    a resumed attempt's points continue the same curves. The exception is
    ``add_scalars(main_tag, {key: ...})``, which writes each key to a directory named
    ``<main_tag with / as _>_<key>`` with tag ``main_tag``: that becomes ``main_tag/key``
    (torch.utils.tensorboard.writer.SummaryWriter.add_scalars).
    """
    head = tag.replace("/", "_") + "_"
    if len(subdir) > len(head) and subdir.startswith(head):
        return f"{tag}/{subdir[len(head) :]}"
    return tag


def _log_failed(path: Path, exc: Exception) -> None:
    log.warning(
        "tensorboard: %s is damaged or unreadable (%s: %s): its later records are skipped",
        path,
        type(exc).__name__,
        exc,
    )
