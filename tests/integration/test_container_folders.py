"""A container's writable folder as a tmpfs of its own (vgpu/node/folders.py): size-limited,
nosuid,nodev,noexec, and the bind mount a runtime makes of it keeps all of that. Mounting needs
root; without it these tests skip, saying so."""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from vgpu.node import folders
from vgpu.node.folders import TMPFS_BYTES

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


def _options(path: Path) -> tuple[str, set[str]]:
    """(file system type, mount options) of the mount at ``path``, from mountinfo."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(path):
            after = fields[fields.index("-") + 1 :]
            return after[0], set(fields[5].split(","))
    raise AssertionError(f"{path} is not a mount point")


def _bind(source: Path, target: Path) -> None:
    target.mkdir()
    libc = ctypes.CDLL(None, use_errno=True)
    assert (
        libc.mount(os.fsencode(source), os.fsencode(target), None, 4096 | 16384, None) == 0
    )  # MS_BIND|MS_REC


def test_a_tmpfs_folder_holds_the_region_and_no_more_and_runs_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "containers" / "pod_main"
    bound = tmp_path / "in-the-container"
    try:
        folders.make(folder, folders.TMPFS)
        folders.make(folder, folders.TMPFS)  # idempotent: kubelet may call Allocate again
        kind, options = _options(folder)
        assert kind == "tmpfs" and {"nosuid", "nodev", "noexec"} <= options
        assert stat.S_IMODE(folder.stat().st_mode) == 0o777
        assert stat.S_IMODE(folder.parent.stat().st_mode) == 0o700
        (folder / "vgpu.region").write_bytes(b"\0" * (TMPFS_BYTES // 2))  # a region fits
        with pytest.raises(OSError) as full:
            (folder / "filler").write_bytes(b"\0" * TMPFS_BYTES)
        assert full.value.errno == errno.ENOSPC
        (folder / "filler").unlink()
        # what the container sees: a bind mount of it, as runc makes one, keeps the flags
        _bind(folder, bound)
        _, options = _options(bound)
        assert {"nosuid", "nodev", "noexec"} <= options
        tool = bound / "tool"
        tool.write_text("#!/bin/sh\necho ran\n")
        tool.chmod(0o755)
        with pytest.raises(PermissionError):
            subprocess.run([str(tool)], check=False)
    finally:
        if os.path.ismount(bound):
            ctypes.CDLL(None).umount2(os.fsencode(bound), 2)
        folders.remove(folder)
    assert not folder.exists() and not os.path.ismount(folder)


def test_a_plain_folder_is_kept_where_tmpfs_is_not_asked_for(tmp_path: Path) -> None:
    folder = tmp_path / "containers" / "pod_main"
    folders.make(folder, folders.DIRECTORY)
    assert not os.path.ismount(folder) and stat.S_IMODE(folder.stat().st_mode) == 0o777
    folders.remove(folder)
    folders.remove(folder)  # nothing there is no error
    assert not folder.exists()


def test_a_folder_mounted_more_than_once_is_removed_whole(tmp_path: Path) -> None:
    """After a helm upgrade the new plugin's shared /var/lib/vgpu may hold the old plugin's tmpfs
    twice (its bind's copy and the propagated one): one unmount left a mount point that rmtree
    could not remove, and the folder (and every hook version with it) stayed forever."""
    folder = tmp_path / "containers" / "pod_main"
    folders.make(folder, folders.TMPFS)
    (folder / "vgpu.region").write_bytes(b"region")
    folders._mount_tmpfs(folder)  # a second tmpfs over the first, as propagation stacks one
    folders._mount_tmpfs(folder)
    assert sum(line.split()[4] == str(folder) for line in open("/proc/self/mountinfo")) == 3
    folders.remove(folder)
    assert not folder.exists() and not os.path.ismount(folder)


_UNDER_A_VIEW_OF_THE_HOST = """
import ctypes, os, sys
from pathlib import Path
from vgpu.node import folders

folder, view = Path(sys.argv[1]), Path(sys.argv[2])
folders.make(folder, folders.TMPFS)
view.mkdir()
libc = ctypes.CDLL(None, use_errno=True)
# the chart's driver-root volume: the host's / bound, with every mount under it, into the pod
assert libc.mount(b"/", os.fsencode(view), None, 4096 | 16384, None) == 0  # MS_BIND|MS_REC
assert os.path.ismount(str(view) + str(folder))
folders.remove(folder)
print("gone" if not folder.exists() and not os.path.exists(str(view) + str(folder)) else "left")
"""


def test_a_folder_seen_under_a_view_of_the_host_is_removed_whole(tmp_path: Path) -> None:
    """A plugin pod holds the host's / at /driver-root: a tmpfs there before it started is
    mounted twice in its namespace, and rmdir of the folder is EBUSY until both are off."""
    folder = tmp_path / "containers" / "pod_main"
    done = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            sys.executable,
            "-c",
            _UNDER_A_VIEW_OF_THE_HOST,
            str(folder),
            str(tmp_path / "driver-root"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0 and done.stdout.strip() == "gone", done.stdout + done.stderr
