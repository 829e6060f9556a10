"""A container's writable region folder on the host: made, and removed (docs/security.md).

The folder is the one host path a container may write (its processes, whatever their user,
create the region file of contract 5 there), so it is the one place a tenant could fill the
node's disk from or leave a program to run. With ``containerFolder: tmpfs`` (the chart's default)
it is a small tmpfs of its own, mounted ``nosuid,nodev,noexec``: the region and little else fits
(:data:`TMPFS_BYTES`, :data:`TMPFS_INODES`), in memory charged to the container's cgroup, and the
bind mount kubelet makes of it keeps those flags. ``directory`` is a plain folder (the sandbox's
simulated nodes, a plugin without CAP_SYS_ADMIN). Either way its parent is 0700: on the host only
root reaches it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from pathlib import Path

from vgpu.hookabi.layout import REGION_SIZE

# Room for the region (about 0.3 MiB) twice over, rounded to whole MiB; a few inodes.
TMPFS_BYTES = max(1 << 20, -(-2 * REGION_SIZE // (1 << 20)) << 20)
TMPFS_INODES = 64
TMPFS = "tmpfs"
DIRECTORY = "directory"
FOLDER_KINDS = (TMPFS, DIRECTORY)
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_MNT_DETACH = 2
_MAX_STACKED = 16  # mounts of one folder taken off before giving up
_SOURCE = b"vgpu-region"  # the tmpfs's name in mountinfo


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _mount_tmpfs(folder: Path) -> None:
    options = f"size={TMPFS_BYTES},nr_inodes={TMPFS_INODES},mode=0777".encode()
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    if _libc().mount(_SOURCE, os.fsencode(folder), b"tmpfs", flags, options) != 0:
        code = ctypes.get_errno()
        raise OSError(
            code,
            f"cannot mount a tmpfs at {folder} ({os.strerror(code)}): the plugin needs CAP_SYS_ADMIN "
            "and, in a pod, its /var/lib/vgpu mounted with mountPropagation Bidirectional (the chart "
            "does both); or set containerFolder: directory in the node config",
        )


def make(folder: Path, kind: str) -> None:
    """The container's folder at ``folder`` (idempotent: a folder already made is kept as it is)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.parent.chmod(0o700)  # only root reaches the folders on the host
    folder.mkdir(exist_ok=True)
    if kind == TMPFS and not os.path.ismount(folder):
        try:
            _mount_tmpfs(folder)
        except OSError:
            folder.rmdir()  # no folder without its tmpfs: a restarted plugin reads folders as served
            raise
    folder.chmod(0o777)  # the container's processes, whatever their user, create the region


def _elsewhere(folder: Path) -> list[bytes]:
    """Where else in this mount namespace the folder's tmpfs is mounted: under another view of
    the host's tree (a plugin pod's ``/driver-root``, a bind of ``/``), which holds the folder
    busy on the host until it is taken off too. Only our tmpfs (named :data:`_SOURCE`) counts."""
    suffix = os.fsencode(folder)
    found = []
    with open("/proc/self/mountinfo", "rb") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            after = fields[fields.index(b"-") + 1 :]
            point = fields[4].replace(b"\\040", b" ")
            if after[:2] == [b"tmpfs", _SOURCE] and point != suffix and point.endswith(suffix):
                found.append(point)
    return found


def _unmount(point: bytes) -> None:
    if _libc().umount2(point, _MNT_DETACH) != 0:
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOENT):
            raise OSError(code, f"cannot unmount the tmpfs at {os.fsdecode(point)}: {os.strerror(code)}")


def remove(folder: Path) -> None:
    """Remove the folder and what is in it, unmounting its tmpfs first; nothing there is no error.

    The tmpfs may be mounted more than once: stacked where a mount another plugin made (the one
    before an upgrade) reaches the folder both with a shared bind and by propagation, and under
    other views of the host's tree the plugin holds. Each is taken off; a folder left behind
    raises OSError."""
    for _ in range(_MAX_STACKED):
        if not os.path.ismount(folder):
            break
        _unmount(os.fsencode(folder))
    for point in _elsewhere(folder):
        _unmount(point)

    Info = tuple[type[BaseException], BaseException, object]

    def gone_already(_func: object, path: str, info: Info) -> None:
        error = info[1]
        if not isinstance(error, FileNotFoundError):
            raise OSError(getattr(error, "errno", None), f"cannot remove {path}: {error}")

    shutil.rmtree(folder, onerror=gone_already)
