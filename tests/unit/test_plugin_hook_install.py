"""The hook library lands in a folder named by its content and is never overwritten in place;
a version stays while a container of the node was handed it and goes after (vgpu/node/hooklib.py)."""

from __future__ import annotations

import mmap
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from vgpu.node.hooklib import HookInstall, collect, hand_out, handed_out, install_hook, version_of
from vgpu.node.paths import HostPaths, sweep_container_dirs


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

    from vgpu.node.paths import sweep_container_dirs

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


def test_the_sweep_never_takes_a_dra_claims_folder_or_grant_for_a_gone_pods(tmp_path: Path) -> None:
    import os

    from vgpu.node.paths import sweep_container_dirs

    paths = HostPaths(tmp_path)
    claim = "dra_7d0e4c51-93a4-4f0e-b1d6-2c3e4f5a6b7c_gpu"
    (paths.containers_dir / claim).mkdir(parents=True)
    paths.grants_dir.mkdir(parents=True)
    (paths.grants_dir / f"{claim}.limits").write_bytes(b"g")
    for entry in (paths.containers_dir / claim, paths.grants_dir / f"{claim}.limits"):
        os.utime(entry, (1000.0, 1000.0))
    assert sweep_container_dirs(paths, set(), min_age_s=300, now=2000.0) == []
    assert (paths.containers_dir / claim).is_dir() and (paths.grants_dir / f"{claim}.limits").exists()


# -- versions kept while a container was handed them, removed after --------------------------

OLD_ENOUGH = 10_000_000_000.0  # a "now" far past every file's mtime: min_age never holds one back


def _build(tmp_path: Path, text: bytes) -> Path:
    src = tmp_path / "image" / version_of(text) / "libvgpu.so"
    src.parent.mkdir(parents=True)
    src.write_bytes(b"\x7fELF " + text)
    return src


def _serve(paths: HostPaths, folder: str, hook: HookInstall | None) -> None:
    """What Allocate does on the host for one container (answer.py): its folder, then the record."""
    (paths.containers_dir / folder).mkdir(parents=True, exist_ok=True)
    hand_out(paths, folder, hook)


def _versions(paths: HostPaths) -> list[str]:
    return sorted(p.name for p in paths.lib_dir.iterdir() if p.is_dir())


def test_an_upgrade_keeps_the_old_version_while_a_container_has_it_and_removes_it_after(
    tmp_path: Path,
) -> None:
    paths = HostPaths(tmp_path / "root")
    old = install_hook(_build(tmp_path, b"v1"), paths)
    _serve(paths, "pod1_main", old)
    # the old library mapped by a running process, as ld.so maps it
    with open(old.library, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        inode = old.library.stat().st_ino
        # the upgrade: a new plugin installs its build and collects at start
        new = install_hook(_build(tmp_path, b"v2"), paths)
        assert new.version != old.version and new.library.parent.parent == old.library.parent.parent
        assert collect(paths, new.version, 0, OLD_ENOUGH) == []
        assert _versions(paths) == sorted([old.version, new.version])
        assert old.library.stat().st_ino == inode and mapped[:] == b"\x7fELF v1"
        _serve(paths, "pod2_main", new)  # a new container gets the new one
        assert (paths.grants_dir / "pod2_main.hook").read_text() == new.version + "\n"
        # a restart of the plugin loses nothing: the records are on the host
        assert install_hook(new.source or Path(), paths) == new
        assert collect(paths, new.version, 0, OLD_ENOUGH) == []
        assert _versions(paths) == sorted([old.version, new.version]) and mapped[:] == b"\x7fELF v1"
    # pod1 leaves the node: the sweep removes its folder, grant and record, then the version goes
    assert [p.name for p in sweep_container_dirs(paths, {"pod2"}, 0, OLD_ENOUGH)] == ["pod1_main"]
    assert not (paths.grants_dir / "pod1_main.hook").exists()
    removed = collect(paths, new.version, 0, OLD_ENOUGH)
    assert old.version in removed and new.version not in removed
    assert new.version in _versions(paths) and old.version not in _versions(paths)


def test_the_newest_is_never_removed_and_a_young_version_waits(tmp_path: Path) -> None:
    paths = HostPaths(tmp_path)
    first = install_hook(_build(tmp_path, b"a"), paths)
    second = install_hook(_build(tmp_path, b"b"), paths)
    assert collect(paths, second.version, 0, OLD_ENOUGH) == [first.version]
    third = install_hook(_build(tmp_path, b"c"), paths)
    # `second` was installed a moment ago (by another plugin, as far as this one knows): it stays
    assert collect(paths, third.version, 300, time.time()) == []
    assert collect(paths, third.version, 300, time.time() + 301) == [second.version]
    assert _versions(paths) == [third.version]
    assert collect(paths, None, 0, OLD_ENOUGH) == [third.version]  # no hook of its own: none kept


def test_a_container_served_without_a_record_keeps_every_version(tmp_path: Path) -> None:
    """A container an older plugin served has a folder but no record: its version is unknown."""
    paths = HostPaths(tmp_path)
    old = install_hook(_build(tmp_path, b"old"), paths)
    (paths.containers_dir / "pod0_main").mkdir(parents=True)  # no hand_out: an older plugin's
    new = install_hook(_build(tmp_path, b"new"), paths)
    _serve(paths, "pod1_main", new)
    _serve(paths, "pod2_main", None)  # a container without a hook records "" and holds nothing
    assert (paths.grants_dir / "pod2_main.hook").read_text() == "\n"
    assert collect(paths, new.version, 0, OLD_ENOUGH) == []
    assert old.library.is_file()
    assert handed_out(paths) == ({new.version}, ["pod0_main"])
    shutil.rmtree(paths.containers_dir / "pod0_main")
    assert collect(paths, new.version, 0, OLD_ENOUGH) == [old.version]


def test_a_crash_mid_install_leaves_no_partial_library_in_place(tmp_path: Path) -> None:
    """The installer is killed (SIGKILL, no clean-up runs) after writing the copy, before the
    rename: the version's path never holds a partial file, the next start completes it and the
    collection removes the leftover copy."""
    paths = HostPaths(tmp_path / "root")
    src = _build(tmp_path, b"x" * 100_000)
    crash = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from vgpu.node import hooklib\n"
        "from vgpu.node.paths import HostPaths\n"
        "real = os.fsync\n"
        "def fsync(fd):\n"
        "    real(fd)\n"
        "    if os.fstat(fd).st_size > 1000:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "os.fsync = fsync\n"
        "hooklib.install_hook(Path(sys.argv[1]), HostPaths(Path(sys.argv[2])))\n"
    )
    done = subprocess.run([sys.executable, "-c", crash, str(src), str(paths.root)], timeout=60)
    assert done.returncode == -signal.SIGKILL
    folder = paths.lib_dir / version_of(src.read_bytes())
    assert not (folder / "libvgpu.so").exists()
    leftovers = [p.name for p in folder.iterdir()]
    assert len(leftovers) == 1 and leftovers[0].startswith(".libvgpu.so.") and leftovers[0].endswith(".tmp")
    hook = install_hook(src, paths)
    assert hook.library.read_bytes() == src.read_bytes()
    assert collect(paths, hook.version, 0, OLD_ENOUGH) == []
    assert sorted(p.name for p in folder.iterdir()) == ["ld.so.preload", "libvgpu.so"]


def test_a_damaged_version_is_replaced_by_a_rename_never_rewritten(tmp_path: Path) -> None:
    paths = HostPaths(tmp_path / "root")
    src = _build(tmp_path, b"good")
    hook = install_hook(src, paths)
    hook.library.write_bytes(b"\x7fELF go")  # cut short (a power loss before the data reached the disk)
    with open(hook.library, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        inode = hook.library.stat().st_ino
        assert install_hook(src, paths) == hook
        assert hook.library.read_bytes() == src.read_bytes() and hook.library.stat().st_ino != inode
        assert mapped[:] == b"\x7fELF go"  # what was mapped is untouched
    assert hook.library.stat().st_mode & 0o777 == 0o755 and hook.preload.stat().st_mode & 0o777 == 0o644


def test_a_version_removed_behind_the_plugins_back_is_put_back_at_the_next_allocate(tmp_path: Path) -> None:
    paths = HostPaths(tmp_path)
    hook = install_hook(_build(tmp_path, b"v"), paths)
    shutil.rmtree(hook.library.parent)
    _serve(paths, "pod_main", hook)
    assert hook.library.read_bytes() == b"\x7fELF v" and hook.preload.is_file()
