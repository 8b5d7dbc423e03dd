"""The workspace wire format: manifest path rules, one tree, the digest, the limits."""

from __future__ import annotations

import hashlib
import time

import pytest
from pydantic import ValidationError

from service.core.wire.workspace import (
    MAX_BYTES_SETTING,
    MAX_FILES_SETTING,
    FileUploadStatus,
    Manifest,
    WorkspaceFile,
    WorkspaceTooLargeError,
    check_limits,
    format_size,
    path_problem,
)

SHA_A = hashlib.sha256(b"a").hexdigest()
SHA_B = hashlib.sha256(b"b").hexdigest()


def wf(path: str, mode: int = 0o644, size: int = 1, sha: str = SHA_A) -> dict[str, object]:
    return {"path": path, "mode": mode, "size_bytes": size, "sha256": sha}


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("/etc/passwd", "absolute"),
        ("../outside.py", "'..' part"),
        ("a/../../b", "'..' part"),
        ("a/./b", "'.' part"),
        ("a//b", "empty part"),
        ("a/", "empty part"),
        ("", "empty"),
        ("a\\b.py", "backslash"),
        ("a\0b", "NUL"),
        ("a\nb", "control character"),
        ("bad\udcff.py", "not valid UTF-8"),
        ("x" * 256, "longer than 255 bytes"),
        ("/".join(["d" * 200] * 21), "longer than 4096 bytes"),
    ],
)
def test_a_bad_path_is_refused_saying_why(path: str, words: str) -> None:
    problem = path_problem(path)
    assert problem is not None and words in problem, problem
    with pytest.raises(ValidationError) as info:
        Manifest.model_validate({"files": [wf(path)]})
    assert words in str(info.value), str(info.value)


@pytest.mark.parametrize("path", ["train.py", "pkg/__init__.py", ".gitignore", "a b/ü.py", "..x"])
def test_normal_paths_are_accepted(path: str) -> None:
    assert path_problem(path) is None
    assert Manifest.model_validate({"files": [wf(path)]}).files[0].path == path


def test_a_path_listed_twice_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"'a.py' is listed twice"):
        Manifest.model_validate({"files": [wf("a.py"), wf("a.py", sha=SHA_B)]})


def test_a_path_both_file_and_directory_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"'pkg' is a file and also the directory of"):
        Manifest.model_validate({"files": [wf("pkg"), wf("pkg/mod.py")]})
    with pytest.raises(ValidationError, match=r"'a/b' is a file and also the directory"):
        Manifest.model_validate({"files": [wf("a/b/c/d.py"), wf("a/b")]})
    # A shared prefix of names is not a directory.
    Manifest.model_validate({"files": [wf("pkg"), wf("pkg2/mod.py"), wf("pk/g")]})


@pytest.mark.parametrize("mode", [0o600, 0o777, 0o100644, 0o4755])
def test_modes_other_than_644_and_755_are_refused(mode: int) -> None:
    with pytest.raises(ValidationError, match=r"0o644 or 0o755"):
        WorkspaceFile.model_validate(wf("a.py", mode=mode))


def test_sizes_and_hashes_are_checked() -> None:
    for bad in (wf("a", size=-1), wf("a", sha="ABC"), wf("a", sha=SHA_A.upper())):
        with pytest.raises(ValidationError):
            WorkspaceFile.model_validate(bad)
    with pytest.raises(ValidationError, match=r"Extra inputs"):
        WorkspaceFile.model_validate({**wf("a"), "uid": 0})


def test_digest_is_the_documented_sha256_and_ignores_order() -> None:
    files = [wf("b.py", sha=SHA_B), wf("a/run.sh", mode=0o755, size=3)]
    one = Manifest.model_validate({"files": files})
    other = Manifest.model_validate({"files": list(reversed(files))})
    text = f"a/run.sh\x00755\x00{SHA_A}\nb.py\x00644\x00{SHA_B}\n"
    assert one.digest() == other.digest() == hashlib.sha256(text.encode()).hexdigest()
    assert (one.file_count, one.total_bytes) == (2, 4)
    # Mode and content are part of it; size is not (the sha256 already says it).
    assert Manifest.model_validate({"files": [wf("b.py", mode=0o755, sha=SHA_B),
                                              files[1]]}).digest() != one.digest()  # fmt: skip


def test_check_limits_names_the_setting_and_the_five_largest_files() -> None:
    sizes = [(f"f{i}.bin", i * 2**20) for i in range(1, 9)] + [("tiny.txt", 3)]
    check_limits(sizes, max_bytes=36 * 2**20 + 3, max_files=9)
    with pytest.raises(WorkspaceTooLargeError) as info:
        check_limits(sizes, max_bytes=10 * 2**20, max_files=100, exclude_with=".gitignore")
    exc = info.value
    assert exc.setting == MAX_BYTES_SETTING and exc.status_code == 413
    assert [p for p, _ in exc.largest] == ["f8.bin", "f7.bin", "f6.bin", "f5.bin", "f4.bin"]
    text = str(exc)
    assert MAX_BYTES_SETTING in text and "f8.bin (8.0 MiB)" in text and ".gitignore" in text
    assert "36.0 MiB is more than 10.0 MiB" in text and "f3.bin" not in text
    with pytest.raises(WorkspaceTooLargeError) as info:
        check_limits(sizes, max_bytes=2**40, max_files=8)
    assert info.value.setting == MAX_FILES_SETTING
    assert "9 files are more than 8" in str(info.value) and MAX_FILES_SETTING in str(info.value)


def test_manifest_check_limits() -> None:
    manifest = Manifest.model_validate({"files": [wf("a", size=10), wf("b", size=20)]})
    manifest.check_limits(max_bytes=30, max_files=2)
    with pytest.raises(WorkspaceTooLargeError, match=r"b \(20 B\), a \(10 B\)"):
        manifest.check_limits(max_bytes=29, max_files=2)


def test_upload_status_carries_the_chunk_loop_fields() -> None:
    status = FileUploadStatus(upload_id=1, sha256=SHA_A, size_bytes=0, received_bytes=0,
                              chunk_bytes=2**20, state="receiving")  # fmt: skip
    assert status.received_bytes == 0 and format_size(1536) == "1.5 KiB"


def test_a_manifest_of_deep_paths_is_checked_in_linear_time() -> None:
    # 2,600 paths of 2,047 parts (the ~11 MB the route's body cap lets in): walking each
    # path's parents, or splitting each into its parts in Python, took 8 s of the event loop.
    deep = "/".join(["a"] * 2046) + "/"
    files = [wf(f"{deep}{i}") for i in range(2600)]
    # This process's CPU seconds, not wall time: other tests' processes share the box's cores.
    started = time.process_time()
    Manifest.model_validate({"files": files})
    assert time.process_time() - started < 2.0, "quadratic again (it took 8 s when it was)"
    # And still finds the clash at the bottom of such a tree.
    with pytest.raises(ValidationError, match=r"is a file and also the directory of"):
        Manifest.model_validate({"files": [*files, wf(deep + "0/x")]})
