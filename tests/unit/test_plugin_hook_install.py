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


def test_region_folders_of_pods_gone_from_the_node_are_swept_once_old(tmp_path: Path) -> None:
    import os

    from vgpu.plugin.paths import sweep_container_dirs

    paths = HostPaths(tmp_path)
    for name in ("live_main", "gone_main", "gone_side", "fresh_main"):
        (paths.containers_dir / name).mkdir(parents=True)
        (paths.containers_dir / name / "vgpu.region").write_bytes(b"x")
    for name in ("live_main", "gone_main", "gone_side"):
        os.utime(paths.containers_dir / name, (1000.0, 1000.0))
    os.utime(paths.containers_dir / "fresh_main", (1990.0, 1990.0))
    paths.grants_dir.mkdir(parents=True)
    for name in ("live_main", "gone_main", "fresh_main"):
        (paths.grants_dir / f"{name}.priority").write_text("1\n")
        os.utime(paths.grants_dir / f"{name}.priority", (1000.0 if name != "fresh_main" else 1990.0,) * 2)
    removed = sweep_container_dirs(paths, {"live"}, min_age_s=300, now=2000.0)
    assert sorted(p.name for p in removed) == ["gone_main", "gone_side"]
    assert sorted(p.name for p in paths.containers_dir.iterdir()) == ["fresh_main", "live_main"]
    # the priority records of gone pods go with their folders
    assert sorted(p.name for p in paths.grants_dir.iterdir()) == ["fresh_main.priority", "live_main.priority"]
