"""The one atomic writer (vgpu/hookabi/files.py) and the grant's one host path
(vgpu/hookabi/grant.py, which vgpu/node/paths.py builds on)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vgpu.hookabi import files
from vgpu.hookabi.files import write_atomic
from vgpu.hookabi.grant import grant_of_container_dir
from vgpu.node.paths import HostPaths


def test_the_file_holds_the_new_bytes_with_the_mode_asked_whatever_the_umask(tmp_path: Path) -> None:
    target = tmp_path / "a.json"
    old = os.umask(0o077)
    try:
        write_atomic(target, b"one", 0o644)
    finally:
        os.umask(old)
    assert target.read_bytes() == b"one" and target.stat().st_mode & 0o777 == 0o644
    write_atomic(target, b"two", 0o600)
    assert target.read_bytes() == b"two" and target.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]  # no temporary file left


def test_a_reader_holding_the_old_file_keeps_its_bytes_the_name_gets_a_new_inode(tmp_path: Path) -> None:
    target = tmp_path / "lib.so"
    write_atomic(target, b"version 1")
    with open(target, "rb") as held:
        before = os.fstat(held.fileno()).st_ino
        write_atomic(target, b"version 2")
        assert held.read() == b"version 1"
    assert target.stat().st_ino != before and target.read_bytes() == b"version 2"


def test_a_write_that_fails_half_way_leaves_the_old_file_whole_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "spec.json"
    write_atomic(target, b"old")

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        write_atomic(target, b"new")
    monkeypatch.undo()
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["spec.json"]


def test_a_missing_folder_is_the_systems_error_not_a_partial_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "absent" / "x", b"x")
    assert not (tmp_path / "absent").exists()


def test_the_grants_host_path_is_the_one_the_hook_finds_beside_a_region(tmp_path: Path) -> None:
    paths = HostPaths(tmp_path)
    folder = paths.container_dir("uid-1", "main")
    assert paths.grant(folder.name) == grant_of_container_dir(folder)
    assert paths.grant(folder.name) == tmp_path / "var/lib/vgpu/grants/uid-1_main.limits"
