"""The packer against hostile or odd trees (real git, real fifos, sockets, devices, links):
whatever would ship bytes from outside the working directory, or cannot be a regular file,
is refused naming the file; hard links ship as independent regular copies."""

from __future__ import annotations

import hashlib
import os
import socket
import stat
from pathlib import Path

import pytest

from service.workspaces.pack import WorkspacePackError, pack_workspace
from tests.procs.test_workspace_pack import LIMITS, _plain_git, git, make_repo, write

__all__ = ["_plain_git"]  # the autouse fixture: git without this machine's config


def test_a_tracked_file_under_a_directory_turned_symlink_out_is_refused(tmp_path: Path) -> None:
    # git keeps listing ``conf/secret.txt`` (tracked) after ``conf`` became a symlink to a
    # directory outside: its lstat is a regular file, its bytes are outside the tree.
    repo = make_repo(tmp_path / "repo")
    write(repo, {"conf/secret.txt": "in the repo\n"})
    git(repo, "add", "conf")
    git(repo, "commit", "-qm", "conf")
    outside = tmp_path / "outside"
    write(outside, {"secret.txt": "host secret\n"})
    (repo / "conf" / "secret.txt").unlink()
    (repo / "conf").rmdir()
    (repo / "conf").symlink_to(outside)
    # The link itself excluded (so not refused as a symlink), the tracked path still listed.
    (repo / ".git" / "info" / "exclude").write_text("/conf\n")
    with pytest.raises(WorkspacePackError, match=r"'conf/secret.txt': a directory above it is "
                       r"a symlink: the file is .*outside\b.*\.gitignore"):  # fmt: skip
        pack_workspace(repo, **LIMITS)


def test_a_directory_symlink_inside_the_tree_is_refused_outside_git_too(tmp_path: Path) -> None:
    # Outside git the walk does not enter a symlinked directory; the link itself is refused
    # (the rank's tree never holds a link), naming how to exclude it.
    write(tmp_path / "w", {"train.py": "x", "src/a.py": "a"})
    (tmp_path / "w" / "alias").symlink_to("src")
    with pytest.raises(WorkspacePackError, match=r"'alias': it is a symlink to the directory"):
        pack_workspace(tmp_path / "w", **LIMITS)


def test_a_socket_is_refused_naming_it(tmp_path: Path) -> None:
    root = tmp_path / "w"
    write(root, {"train.py": "x"})
    # AF_UNIX paths are limited to ~107 bytes: bind by a relative name from the directory.
    here = os.getcwd()
    sock = socket.socket(socket.AF_UNIX)
    try:
        os.chdir(root)
        sock.bind("ctl.sock")
    finally:
        os.chdir(here)
    try:
        with pytest.raises(WorkspacePackError, match=r"'ctl.sock': it is a socket.*\.ddpqignore"):
            pack_workspace(root, **LIMITS)
    finally:
        sock.close()


def test_a_device_file_is_refused_naming_it(tmp_path: Path) -> None:
    write(tmp_path, {"train.py": "x"})
    try:
        os.mknod(tmp_path / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("cannot make a device node here (needs CAP_MKNOD)")
    with pytest.raises(WorkspacePackError, match=r"'null': it is a character device"):
        pack_workspace(tmp_path, **LIMITS)


def test_a_symlink_to_a_device_is_refused(tmp_path: Path) -> None:
    write(tmp_path, {"train.py": "x"})
    (tmp_path / "zero").symlink_to("/dev/zero")  # would never end if read
    with pytest.raises(WorkspacePackError, match=r"'zero': it is a symlink to /dev/zero"):
        pack_workspace(tmp_path, **LIMITS)


def test_hard_links_ship_as_independent_regular_copies(tmp_path: Path) -> None:
    root = tmp_path / "w"
    write(root, {"train.py": "print(1)\n", "data/a.csv": "1,2\n"})
    os.link(root / "data" / "a.csv", root / "b.csv")  # two names, one inode
    # A hard link to a file outside the tree is just a file in the tree (its bytes are the
    # user's to ship, as for any copy): it ships.
    write(tmp_path, {"outside.txt": "shared\n"})
    os.link(tmp_path / "outside.txt", root / "linked.txt")
    packed = pack_workspace(root, **LIMITS)
    by_path = {f.path: f for f in packed.manifest.files}
    assert set(by_path) == {"train.py", "data/a.csv", "b.csv", "linked.txt"}
    assert by_path["b.csv"].sha256 == by_path["data/a.csv"].sha256
    assert by_path["b.csv"].mode == 0o644 and by_path["b.csv"].size_bytes == 4
    assert by_path["linked.txt"].sha256 == hashlib.sha256(b"shared\n").hexdigest()
    # Each name reads its own path: no manifest field says "link".
    assert packed.sources["b.csv"] == root / "b.csv"
