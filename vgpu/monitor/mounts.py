"""Which grant a process runs under, from its ``/proc/<pid>/mountinfo`` as the host sees it.

Both paths that hand out vGPUs bind-mount the container's grant, a file on the host under
``/var/lib/vgpu/grants/``, read-only at ``/etc/vgpu/limits`` (``GRANT_PATH_IN_CONTAINER``): the
device plugin through Allocate's mounts (``<pod-uid>_<container>.limits``), the DRA driver through
the CDI spec NodePrepareResources writes (``dra_<claim-uid>_<request>.limits``). The runtime
makes that mount before the container's first process runs, and a process without
CAP_SYS_ADMIN cannot unmount or replace it; the kernel writes mountinfo, so the tenant cannot
change what it says. The file's name names the grant whatever runtime made the mount (containerd,
CRI-O, Docker) and whatever the container's cgroup path looks like, so the host view finds DRA
containers, whose cgroup says nothing of their claim, and device-plugin containers alike.

A mountinfo line (proc(5))::

    36 35 98:0 /var/lib/vgpu/grants/x.limits /etc/vgpu/limits ro,relatime master:1 - ext4 /dev/sda1 rw

mount id, parent id, the source's device (major:minor), the path of the mounted file inside its
file system, the mount point, the mount's options, optional fields up to ``-``, the file system
type, the source and the super block's options. Paths escape space, tab, newline and backslash as
``\\040``, ``\\011``, ``\\012``, ``\\134``. The "root" is the path inside the file system, so where
``/var/lib`` is a file system of its own it reads ``/vgpu/grants/x.limits``: only the file's name
is used, and the device must be the grants folder's, so a file a privileged tenant bind-mounts
there from its own image (another device: the container's overlay) is not taken for a grant.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from vgpu.hookabi.grant import GRANT_SUFFIX
from vgpu.hookabi.layout import GRANT_PATH_IN_CONTAINER
from vgpu.node.paths import DRA_PREFIX

_ESCAPE = re.compile(r"\\([0-7]{3})")
# a grant's name: the device plugin's <pod-uid>_<container> or DRA's dra_<claim-uid>_<request>
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
DELETED = "//deleted"  # the kernel's mark on a bind mount whose source file was removed


@dataclass(frozen=True)
class MountEntry:
    device: tuple[int, int]  # the source's (major, minor)
    root: str  # the mounted path inside its file system
    mount_point: str
    fs_type: str


def _unescape(field: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[MountEntry]:
    """Every well-formed line of a mountinfo file, in its order; malformed lines are skipped."""
    out: list[MountEntry] = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
            major, minor = (int(x) for x in fields[2].split(":"))
            fs_type = fields[sep + 1]
        except (ValueError, IndexError):
            continue
        out.append(MountEntry((major, minor), _unescape(fields[3]), _unescape(fields[4]), fs_type))
    return out


def grant_name(text: str, device: tuple[int, int] | None = None) -> str | None:
    """The name of the grant mounted at ``/etc/vgpu/limits`` (the file's name without
    ``.limits``), or None: no such mount, its file removed, a name no grant has, or (with
    ``device``, the grants folder's) a file of another device.

    The first such mount counts: the runtime's, made before any process of the container ran.
    """
    for entry in parse_mountinfo(text):
        if entry.mount_point != GRANT_PATH_IN_CONTAINER:
            continue
        if entry.root.endswith(DELETED) or (device is not None and entry.device != device):
            return None
        base = entry.root.rpartition("/")[2]
        if not base.endswith(GRANT_SUFFIX):
            return None
        name = base[: -len(GRANT_SUFFIX)]
        return name if _NAME.match(name) else None
    return None


def device_of(path: Path) -> tuple[int, int] | None:
    """(major, minor) of the file system holding ``path``, as mountinfo writes it; None if unreadable."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    return os.major(dev), os.minor(dev)


def process_grant(pid: int, proc: Path, device: tuple[int, int] | None) -> str | None:
    """:func:`grant_name` of process ``pid``. Raises OSError when the process is gone."""
    return grant_name((proc / str(pid) / "mountinfo").read_text(errors="replace"), device)


def claim_of(grant: str) -> tuple[str, str] | None:
    """(claim UID, request) of a DRA grant's name ``dra_<claim-uid>_<request>``; None for another."""
    prefix, sep, rest = grant.partition("_")
    if prefix != DRA_PREFIX or not sep:
        return None
    claim, sep, request = rest.partition("_")
    return (claim, request) if sep and claim and request else None
