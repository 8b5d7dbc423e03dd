"""How the CLI renders jobs: `ls` at 80 columns, ages, the progress line and the final line of
the live bar (no server; rendered into a real rich Console)."""

from __future__ import annotations

import io
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from rich.console import Console

from service.api.schemas import progress_out
from service.cli.job_data import checkpoints_table
from service.cli.jobs import checkpoint_file
from service.cli.output import (
    epoch_number,
    field_error_lines,
    format_age,
    format_job_summary,
    job_progress,
    jobs_table,
    printable,
    progress_line,
)
from service.core.config import Settings

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
SPINNER_GLYPHS = re.compile("[\u2800-\u28ff]")  # rich's "dots" spinner is braille
CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def render(renderable: Any, width: int) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(renderable)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(text, str)
    return "\n".join(line.rstrip() for line in text.splitlines())


def job(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "id": 3,
        "name": "digits-2",
        "state": "running",
        "attempt": 1,
        "launcher": "local",
        "owner": "alice",
        "progress": {"step": 39, "total_steps": 400, "epoch": 1, "samples_per_s": 123.4,
                     "eta_s": 80.0},
        "latest_metrics": {"loss": 0.123456789},
        "created_at": (NOW - timedelta(minutes=3)).isoformat(),
        "started_at": None,
        "finished_at": None,
        "error": None,
        "cancel_requested": False,
        "queue_reason": None,
    }  # fmt: skip
    return {**base, **changes}


def test_ages() -> None:
    assert format_age((NOW - timedelta(seconds=2)).isoformat(), NOW) == "just now"
    assert format_age((NOW - timedelta(seconds=42)).isoformat(), NOW) == "42s ago"
    assert format_age((NOW - timedelta(minutes=3, seconds=59)).isoformat(), NOW) == "3m ago"
    assert format_age((NOW - timedelta(hours=5)).isoformat(), NOW) == "5h ago"
    assert format_age("2026-02-27T12:00:00Z", NOW) == "2d ago"
    assert format_age("not a time", NOW) == "not a time"


def test_ls_fits_80_columns_cutting_only_the_name() -> None:
    jobs = [
        job(id=1234, name="a-rather-long-name-for-a-digits-baseline-run", state="succeeded",
            progress={"step": 12345, "total_steps": 40000}),
        job(id=1233, name="short", state="cancelled", attempt=12,
            created_at=(NOW - timedelta(days=3)).isoformat()),
        job(id=1232, name="queued-job", state="queued", progress=None, latest_metrics={}),
    ]  # fmt: skip
    text = render(jobs_table(jobs, NOW), 80)
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), text
    assert "…" in text and "a-rather-long-name-for-a-digits-baseline-run" not in text
    row = next(line for line in lines if "1234" in line)
    assert re.search(r"\b1234\s+a-rather-\S*…\s+succeeded\s+1\s+12345/40000\s+0\.1235\s+local"
                     r"\s+3m ago$", row), row  # fmt: skip
    assert re.search(r"1233\s+short\s+cancelled\s+12\b.*3d ago$", text, re.M), text
    assert re.search(r"1232\s+queued-job\s+queued\s+1\s+local\s+3m ago$", text, re.M), text
    assert "2026-" not in text, "ages, not timestamps"


def test_progress_line_like_the_bar() -> None:
    assert progress_line(job()) == "step 39/400 · epoch 2 · 123 samples/s · ETA 1m20s"
    assert progress_line(job(state="failed")) == "step 39/400 · epoch 2 · 123 samples/s"
    assert progress_line(job(progress={"step": 5})) == "step 5"
    assert progress_line(job(progress=None)) == ""


def test_summary_shows_progress_queue_reason_and_checkpoint_file() -> None:
    ckpt = {"step": 230, "size_bytes": 2048, "sha256": "ab" * 32, "path": "jobs/3/x.pt"}
    text = render(
        format_job_summary(job(), ckpt, "http://h/ckpt", "http://h/jobs/3", "/a/jobs/3/x.pt"),
        120,
    )
    assert re.search(r"^progress\s+step 39/400 · epoch 2 · 123 samples/s · ETA 1m20s$", text, re.M)
    assert re.search(r"^file\s+/a/jobs/3/x\.pt$", text, re.M), text
    assert re.search(r"^owner\s+alice$", text, re.M), text
    assert not re.search(r"^queued", text, re.M), "only a queued job says why it waits"
    queued = job(state="queued", progress=None, queue_reason="no live worker for launcher local")
    text = render(format_job_summary(queued, None, None, "http://h/jobs/3"), 120)
    assert re.search(r"^queued\s+no live worker for launcher local$", text, re.M), text


def test_final_bar_line_has_the_end_mark_and_the_last_step() -> None:
    console = Console(file=io.StringIO(), width=120, force_terminal=True, color_system=None)
    with job_progress(console) as update:
        update(job(progress={"step": 2, "total_steps": 48, "epoch": 0}))
        update(job(state="failed", progress={"step": 5, "total_steps": 48, "epoch": 0}))
    final = console.file.getvalue().rsplit("\r", 1)[-1]  # type: ignore[attr-defined]
    assert "job 3 failed" in final and "step 5/48" in final, repr(final)
    assert "✗" in final and not SPINNER_GLYPHS.search(final), repr(final)


def test_bar_shows_why_a_queued_job_waits() -> None:
    console = Console(file=io.StringIO(), width=160, color_system=None)
    reason = "waiting for a worker with 1 free GPU (live workers have at most 0)"
    with job_progress(console) as update:
        update(job(state="queued", progress=None, queue_reason=reason))
    assert reason in console.file.getvalue()  # type: ignore[attr-defined]


EVIL = "a\x1b[31mred\x1b]0;title\x07\u202eb[bold]x[/bold]"
ESCAPED = "a\\x1b[31mred\\x1b]0;title\\x07\\u202eb[bold]x[/bold]"


def test_ls_and_summary_escape_control_characters_and_markup() -> None:
    evil = job(
        name=EVIL, launcher="[red]local", state="running\x1b[2J", queue_reason=EVIL,
        latest_metrics={EVIL: 1.0, "loss": "[b]Infinity"}, error=f"line 1 {EVIL}\nline 2",
    )  # fmt: skip
    for renderable in (
        jobs_table([evil], now=NOW),
        format_job_summary(evil, None, None, "http://h/jobs/3\x1b[0m"),
    ):
        text = render(renderable, 400)
        assert not CONTROL.search(text), repr(text)
        assert "\\x1b[31mred" in text and "\\u202e" in text, text
        assert "[bold]x[/bold]" in text, "markup in data is shown, not applied"
    table = render(jobs_table([evil], now=NOW), 400)
    assert "[red]local" in table and "[b]Infinity" in table and "running\\x1b[2J" in table
    summary = render(format_job_summary(evil, None, None, "http://h/jobs/3"), 400)
    assert ESCAPED in summary
    assert re.search(r"line 1 .*\n\s+line 2", summary), "an error keeps its line breaks"


def test_printable_and_field_errors() -> None:
    assert printable(EVIL) == ESCAPED
    assert printable("tab\there\nnl") == "tab\\there\\nnl"
    assert printable("tab\there\nnl", keep_newlines=True) == "tab\there\nnl"
    assert printable("ünï €") == "ünï €" and printable("\ud800") == "\\ud800"
    detail = [{"loc": ["body", "config", "k\x1b"], "msg": "bad \x1b[31m", "type": "x"}, "\x07"]
    assert field_error_lines(detail) == ["config.k\\x1b: bad \\x1b[31m", "\\x07"]


def test_the_cli_shows_the_apis_epoch_number_not_its_own_arithmetic() -> None:
    """``epoch`` is 0-based (as in code), ``epoch_number`` 1-based (as shown): the CLI prints
    ``epoch_number`` as it is, and falls back to ``epoch + 1`` only when a server sends none."""
    out = progress_out({"step": 39, "total_steps": 400, "epoch": 1})
    assert out is not None and (out.epoch, out.epoch_number) == (1, 2)
    api_job = job(progress=out.model_dump())
    assert progress_line(api_job).startswith("step 39/400 · epoch 2"), progress_line(api_job)
    assert epoch_number({"epoch": 4, "epoch_number": 5}) == 5
    assert epoch_number({"epoch": 4}) == 5, "an older server: only the 0-based epoch"
    assert epoch_number({"epoch": None}) is None


def test_the_checkpoints_table_names_a_followed_checkpoints_file_only_when_there_is_one() -> None:
    base = {"step": 10, "epoch": 0, "epoch_number": 1, "attempt": 1, "size_bytes": 1000,
            "sha256": "a" * 64, "created_at": NOW.isoformat(), "store": "filesystem"}  # fmt: skip
    followed = render(checkpoints_table(3, [base | {"file_name": "ckpt/e1.pt"}, base]), 120)
    assert "file" in followed.splitlines()[2] and "ckpt/e1.pt" in followed
    assert "file" not in render(checkpoints_table(3, [base]), 120).splitlines()[2]


def test_the_checkpoint_file_is_a_local_path_only_where_this_machine_holds_it(
    tmp_path: Path,
) -> None:
    """``ddpq show``'s "file": this machine's path when its artifact dir holds the file,
    else the server's relative path, saying where it is and how to fetch it."""
    settings = Settings(home=tmp_path / ".ddpq", artifact_dir=tmp_path / "artifacts")
    checkpoint = {"path": "jobs/1/checkpoints/step-4.upload-2.pt"}
    elsewhere = checkpoint_file(settings, checkpoint)
    assert elsewhere is not None and elsewhere.startswith("jobs/1/checkpoints/step-4.upload-2.pt")
    assert "API server's artifact dir" in elsewhere and "--download" in elsewhere, elsewhere
    local = settings.resolved_artifact_dir / checkpoint["path"]
    local.parent.mkdir(parents=True)
    local.write_bytes(b"x")
    assert checkpoint_file(settings, checkpoint) == str(local)
    assert checkpoint_file(settings, None) is None
