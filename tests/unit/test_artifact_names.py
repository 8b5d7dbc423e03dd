"""Every artifact file name has one builder and one parser in ``service.core.artifacts``: what
one writes the other reads back, and the parser refuses every other name (another kind of
artifact, a temporary file, a number ``int`` would not write)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from service.core import artifacts as a

NUMBERS = [0, 1, 7, 10, 123_456, 2**63 - 1]

SINGLE: list[tuple[Callable[[int], str], Callable[[str], int | None]]] = [
    (a.rank_log_name, a.parse_rank_log_name),
    (a.rank_error_name, a.parse_rank_error_name),
    (a.checkpoint_name, a.parse_checkpoint_name),
    (a.upload_partial_name, a.parse_upload_partial_name),
]
PAIRS: list[tuple[Callable[[int, int], str], Callable[[str], tuple[int, int] | None]]] = [
    (a.uploaded_checkpoint_name, a.parse_uploaded_checkpoint_name),
    (a.checkpoint_download_name, a.parse_checkpoint_download_name),
]
OTHERS = [
    "step-07.pt",  # a leading zero: not a name we write
    "step-.pt",
    "step--1.pt",
    "step-1.pt.tmp-12-34",
    ".step-1.pt.link-99",
    "step-\u0663.pt",  # a non-ASCII digit
    "rank-1.log.1",
    "error-rank-x.json",
    "job-1-step-2.pt.part",
    "",
]


@pytest.mark.parametrize(("build", "parse"), SINGLE)
@pytest.mark.parametrize("n", NUMBERS)
def test_one_number_names_round_trip(
    build: Callable[[int], str], parse: Callable[[str], int | None], n: int
) -> None:
    assert parse(build(n)) == n


@pytest.mark.parametrize(("build", "parse"), PAIRS)
@pytest.mark.parametrize(("x", "y"), [(0, 0), (7, 3), (2**63 - 1, 10**12)])
def test_two_number_names_round_trip(
    build: Callable[[int, int], str],
    parse: Callable[[str], tuple[int, int] | None],
    x: int,
    y: int,
) -> None:
    assert parse(build(x, y)) == (x, y)


def test_each_parser_refuses_the_other_names() -> None:
    parsers = [p for _, p in SINGLE] + [p for _, p in PAIRS]
    builders: list[str] = [b(5) for b, _ in SINGLE] + [b(5, 6) for b, _ in PAIRS]
    for parse in parsers:
        own = [name for name in builders if parse(name) is not None]
        assert len(own) == 1, f"{parse.__name__} reads {own}"
        for other in OTHERS:
            assert parse(other) is None, f"{parse.__name__}({other!r})"


def test_paths_are_built_from_the_names(tmp_path: Path) -> None:
    assert a.checkpoint_path(tmp_path, 3, 40).name == a.checkpoint_name(40)
    assert a.rank_log_path(tmp_path, 3, 2, 1).name == a.rank_log_name(1)
    assert a.rank_error_path(tmp_path, 3, 2, 1).name == a.rank_error_name(1)
    assert a.relative_checkpoint_path(3, 40) == "jobs/3/checkpoints/step-40.pt"
    assert Path(tmp_path, a.relative_checkpoint_path(3, 40)) == a.checkpoint_path(tmp_path, 3, 40)
    assert a.slurm_stderr_name("123_4") == "123_4_0_log.err"


def test_globs_find_what_the_parsers_read(tmp_path: Path) -> None:
    directory = a.checkpoint_dir(tmp_path, 1)
    directory.mkdir(parents=True)
    names = [a.checkpoint_name(5), a.uploaded_checkpoint_name(5, 2), a.upload_partial_name(2)]
    for name in [*names, "step-05.pt"]:
        (directory / name).touch()
    steps = [a.parse_checkpoint_name(p.name) for p in directory.glob(a.CHECKPOINT_GLOB)]
    assert sorted(s for s in steps if s is not None) == [5], "only the ranks' own name"


def test_rank_error_files_are_the_ranks_in_order(tmp_path: Path) -> None:
    for rank in (10, 2, 0):
        a.rank_error_path(tmp_path, 1, 1, rank).parent.mkdir(parents=True, exist_ok=True)
        a.rank_error_path(tmp_path, 1, 1, rank).write_text("{}")
    attempt = a.attempt_dir(tmp_path, 1, 1)
    (attempt / "error-rank-x.json").write_text("{}")
    assert [p.name for p in a.rank_error_files(attempt)] == [
        a.rank_error_name(0),
        a.rank_error_name(2),
        a.rank_error_name(10),
    ]
    assert a.rank_error_files(tmp_path / "absent") == []


@pytest.mark.parametrize(
    ("relative", "under", "job"),
    [
        ("jobs/7/checkpoints/step-1.pt", None, 7),
        ("jobs/7/checkpoints/step-1.pt", "checkpoints", 7),
        ("jobs/7/attempt-1/rank-0.log", "checkpoints", None),
        ("jobs/7/checkpoints", "checkpoints", None),  # the directory, not a file in it
        ("jobs/07/checkpoints/step-1.pt", None, None),  # not job 7's directory
        ("jobs/x/checkpoints/step-1.pt", None, None),
        ("slurm-arrays/7-1/elements.json", None, None),
        ("jobs", None, None),
    ],
)
def test_job_of_relative_path(relative: str, under: str | None, job: int | None) -> None:
    assert a.job_of_relative_path(relative, under=under) == job


@pytest.mark.parametrize("kind", ["tmp", "link"])
def test_temporary_paths_are_hidden_siblings_that_parse_back(tmp_path: Path, kind: str) -> None:
    final = a.checkpoint_path(tmp_path, 1, 5)
    temp = a.temporary_path(final, kind)
    assert temp.parent == final.parent and temp.name.startswith(".")
    assert a.parse_temporary_name(temp.name) == (final.name, kind)
    assert a.parse_checkpoint_name(temp.name) is None
    final.parent.mkdir(parents=True)
    temp.touch()
    assert not list(final.parent.glob(a.CHECKPOINT_GLOB)), "no glob takes it for the file"
    assert a.parse_temporary_name(final.name) is None
