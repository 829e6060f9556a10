"""The hook library lands in a folder named by its content and is never overwritten in place."""

from __future__ import annotations

from pathlib import Path

from vgpu.plugin.paths import HostPaths, install_hook


def test_a_new_build_lands_beside_the_old_one_which_stays_intact(tmp_path: Path) -> None:
    paths = HostPaths(tmp_path / "root")
    src = tmp_path / "libvgpu.so"
    src.write_bytes(b"build 1")
    first = install_hook(src, paths)
    inode = first.library.stat().st_ino
    assert install_hook(src, paths) == first
    assert first.library.stat().st_ino == inode  # same version: the file is not rewritten
    src.write_bytes(b"build 2")
    second = install_hook(src, paths)
    assert second.version != first.version
    assert first.library.read_bytes() == b"build 1"
    assert second.library.read_bytes() == b"build 2"
    assert second.library.parent.parent == paths.lib_dir
    assert second.preload.read_text() == "/usr/local/vgpu/libvgpu.so\n"
