"""Reading a command job's TensorBoard scalars (``metrics.tensorboard``) as the script writes
them: real event files from torch's SummaryWriter (in this process: its writer is a thread),
read with TensorBoard's own loader, poll after poll."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.plugins.scalar.summary_v2 import scalar_pb
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.summary.writer.record_writer import RecordWriter
from tensorboard.util.tensor_util import make_tensor_proto
from torch.utils.tensorboard import SummaryWriter

from worker.runtime.script.tensorboard import (
    STUCK_GROWTHS,
    Scalar,
    TensorBoardScalars,
    TensorBoardUnavailableError,
    tensorboard_available,
)

LOGGER = "worker.runtime.script.tensorboard"


def points(scalars: list[Scalar]) -> list[tuple[str, int, float]]:
    return [(s.name, s.step, s.value) for s in scalars]


def event_file(directory: Path) -> Path:
    (found,) = directory.glob("events.out.tfevents.*")
    return found


def test_scalars_come_back_by_tag_and_global_step(tmp_path: Path) -> None:
    logdir = tmp_path / "runs"
    with SummaryWriter(str(logdir)) as writer:
        writer.add_scalar("loss", 0.5, 1, walltime=1_700_000_000.25)
        writer.add_scalar("loss", 0.25, 2)
        writer.add_scalar("train/lr", 0.125, 2)
        writer.add_scalar("no_step", 3.0)  # global_step None: written as 0, kept as 0
        writer.add_text("notes", "not a scalar", 2)
        writer.add_histogram("weights", np.array([1.0, 2.0, 3.0]), 2)
    # torch writes the old encoding (simple_value), which the reader must take too.
    (raw, *_) = [
        e for e in LegacyEventFileLoader(str(event_file(logdir))).Load() if e.summary.value
    ]
    assert raw.summary.value[0].WhichOneof("value") == "simple_value", raw

    scalars = TensorBoardScalars(logdir).poll()

    assert points(scalars) == [
        ("loss", 1, 0.5),
        ("loss", 2, 0.25),
        ("train/lr", 2, 0.125),
        ("no_step", 0, 3.0),
    ], "only the scalars, with their tags and steps (text and histograms are not metrics)"
    assert scalars[0].wall_time == 1_700_000_000.25


def test_each_poll_returns_only_what_was_written_since_the_last(tmp_path: Path) -> None:
    writer = SummaryWriter(str(tmp_path))
    reader = TensorBoardScalars(tmp_path)
    try:
        writer.add_scalar("loss", 1.0, 1)
        writer.flush()
        assert points(reader.poll()) == [("loss", 1, 1.0)]
        assert reader.poll() == [], "nothing new was written"
        writer.add_scalar("loss", 2.0, 2)
        writer.add_scalar("loss", 3.0, 3)
        writer.flush()
        assert points(reader.poll()) == [("loss", 2, 2.0), ("loss", 3, 3.0)]
    finally:
        writer.close()


def test_an_event_file_that_appears_later_is_read(tmp_path: Path) -> None:
    reader = TensorBoardScalars(tmp_path)
    with SummaryWriter(str(tmp_path)) as first:
        first.add_scalar("loss", 1.0, 1)
    assert points(reader.poll()) == [("loss", 1, 1.0)]
    # A restarted attempt writes to the same directory: a second file beside the first.
    with SummaryWriter(str(tmp_path)) as second:
        second.add_scalar("loss", 0.5, 2)
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    assert points(reader.poll()) == [("loss", 2, 0.5)], "the new file, and only it"


def test_run_directories_are_not_part_of_the_name_add_scalars_keys_are(tmp_path: Path) -> None:
    """``SummaryWriter()`` writes to ``runs/<date>_<host>/`` (a new directory per attempt):
    the same tag keeps one name across them. ``add_scalars`` keys become ``main/key``."""
    with SummaryWriter(str(tmp_path / "Dec02_14-46-40_vm")) as writer:
        writer.add_scalars("loss/ema", {"train": 1.0, "val": 2.0}, 5)
        writer.add_scalar("Loss/train", 0.5, 5)
    (tmp_path / "nested" / "deeper").mkdir(parents=True)
    with SummaryWriter(str(tmp_path / "nested" / "deeper")) as writer:
        writer.add_scalar("Loss/train", 0.25, 6)

    named = sorted((s.name, s.step) for s in TensorBoardScalars(tmp_path).poll())

    assert named == [("Loss/train", 5), ("Loss/train", 6), ("loss/ema/train", 5),
                     ("loss/ema/val", 5)]  # fmt: skip


def test_a_missing_log_directory_reads_nothing_until_the_script_creates_it(
    tmp_path: Path,
) -> None:
    logdir = tmp_path / "not" / "yet"
    reader = TensorBoardScalars(logdir)
    assert reader.poll() == [] and not logdir.exists()
    with SummaryWriter(str(logdir)) as writer:
        writer.add_scalar("loss", 1.0, 1)
    assert points(reader.poll()) == [("loss", 1, 1.0)]


@pytest.mark.parametrize("cut", [1, 9, 14, -2], ids=["header", "header-crc", "data", "data-crc"])
def test_a_record_cut_mid_write_is_read_once_whole(tmp_path: Path, cut: int) -> None:
    """A poll that finds the last record half written gets the records before it; the next
    poll, after the rest arrived, gets that record: once, none lost."""
    with SummaryWriter(str(tmp_path / "whole")) as writer:
        writer.add_scalar("loss", 1.0, 1)
        writer.flush()
        last_start = event_file(tmp_path / "whole").stat().st_size
        writer.add_scalar("loss", 2.0, 2)
    whole = event_file(tmp_path / "whole").read_bytes()
    at = last_start + cut if cut > 0 else len(whole) + cut
    assert last_start < at < len(whole), "the cut falls inside the last record"
    growing = tmp_path / "growing" / event_file(tmp_path / "whole").name
    growing.parent.mkdir()
    growing.write_bytes(whole[:at])
    reader = TensorBoardScalars(growing.parent)

    assert points(reader.poll()) == [("loss", 1, 1.0)]
    assert reader.poll() == [], "still half written"
    with growing.open("ab") as f:
        f.write(whole[at:])
    assert points(reader.poll()) == [("loss", 2, 2.0)]
    assert reader.poll() == []


def test_a_damaged_record_is_logged_once_and_the_other_files_still_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with SummaryWriter(str(tmp_path / "src")) as writer:
        writer.add_scalar("loss", 1.0, 1)
        writer.flush()
        damaged_at = event_file(tmp_path / "src").stat().st_size + 14  # the 2nd record's data
        writer.add_scalar("loss", 2.0, 2)
    data = bytearray(event_file(tmp_path / "src").read_bytes())
    data[damaged_at] ^= 0xFF
    damaged = tmp_path / "runs" / "events.out.tfevents.1.damaged"
    damaged.parent.mkdir()
    damaged.write_bytes(bytes(data))
    with SummaryWriter(str(tmp_path / "runs" / "other")) as writer:
        writer.add_scalar("acc", 0.5, 1)
    reader = TensorBoardScalars(tmp_path / "runs")

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first = points(reader.poll())
        for _ in range(STUCK_GROWTHS + 2):  # the script keeps writing after the damage
            with damaged.open("ab") as f:
                f.write(data[damaged_at - 14 :])
            assert reader.poll() == []

    assert first == [("loss", 1, 1.0), ("acc", 1, 0.5)], "the records before the damage"
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 1 and str(damaged) in warnings[0], warnings


def test_a_file_whose_records_are_no_events_is_logged_once_and_never_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    not_events = tmp_path / "events.out.tfevents.2.not-events"
    with not_events.open("wb") as f:  # valid records (checksums) around a bad protobuf
        RecordWriter(f).write(b"\x0a\xff\xff\xff\xff\x0f")
    (tmp_path / "events.out.tfevents.3.garbage").write_bytes(b"no record at all" * 4)
    with SummaryWriter(str(tmp_path)) as writer:
        writer.add_scalar("loss", 1.0, 1)
    reader = TensorBoardScalars(tmp_path)

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert points(reader.poll()) == [("loss", 1, 1.0)]
        assert reader.poll() == []

    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 1 and "DecodeError" in warnings[0], warnings


def test_tensor_form_scalars_are_read_though_only_the_first_names_its_plugin(
    tmp_path: Path,
) -> None:
    writer = EventFileWriter(str(tmp_path))
    for step, value in [(1, 0.5), (2, 0.25)]:
        summary = scalar_pb("acc", value)
        # Another plugin's one-number tensor: no metric, on its later values too.
        other = summary.value.add(tag="custom", tensor=make_tensor_proto(7.0))
        other.metadata.plugin_data.plugin_name = "custom_plugin"
        if step > 1:  # as TF2 writes it: the plugin metadata on a tag's first value only
            for value_ in summary.value:
                value_.ClearField("metadata")
        writer.add_event(Event(step=step, wall_time=100.0 + step, summary=summary))
    writer.close()

    scalars = TensorBoardScalars(tmp_path).poll()

    assert points(scalars) == [("acc", 1, 0.5), ("acc", 2, 0.25)]
    assert scalars[1].wall_time == 102.0


def test_without_tensorboard_the_error_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert tensorboard_available()
    monkeypatch.setitem(sys.modules, "tensorboard.backend.event_processing.event_file_loader", None)

    assert not tensorboard_available()
    with pytest.raises(TensorBoardUnavailableError, match="pip install tensorboard") as caught:
        TensorBoardScalars(tmp_path)
    assert caught.value.code == "tensorboard_unavailable"


def test_only_regular_files_inside_the_workspace_are_read(tmp_path: Path) -> None:
    """A fifo named like an event file would block the reader (and every upload behind it);
    a symbolic link, or a log directory that leads out of the workspace, would read another
    job's files: none of them is read."""
    workspace, outside = tmp_path / "ws", tmp_path / "other-job"
    with SummaryWriter(str(outside)) as writer:
        writer.add_scalar("stolen", 1.0, 1)
    runs = workspace / "runs"
    runs.mkdir(parents=True)
    os.mkfifo(runs / "events.out.tfevents.fifo")
    (runs / "events.out.tfevents.link").symlink_to(event_file(outside))
    with SummaryWriter(str(runs)) as writer:
        writer.add_scalar("loss", 0.5, 1)
    assert points(TensorBoardScalars(runs, within=workspace).poll()) == [("loss", 1, 0.5)]

    (workspace / "out").symlink_to(outside)
    assert TensorBoardScalars(workspace / "out", within=workspace).poll() == []
