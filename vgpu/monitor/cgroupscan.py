"""The vGPU containers' cgroup folders, found by walking the cgroup v2 tree: what the driver's
memory cap (``vgpu.monitor.drivercap``) is set on.

The walk starts at the cgroup root the node monitor sees (``vgpu.monitor.freezer``'s: the
host's ``/sys/fs/cgroup``, or the kubelet's part of it mounted under ``/host``), goes down
through the folders that hold containers (``kubepods*``, ``pod*``, the QoS classes, ``k8s.io``,
``docker``, ``system.slice``; not a host's services and users), and stops at a container's
folder: one whose path names a container (``vgpu.monitor.cgroup.parse_path``: containerd,
CRI-O, Docker, under the systemd and cgroupfs drivers). Of a container not seen before it reads
one process (``cgroup.procs``, its own or a child folder's) and the grant that process runs under
(``/proc/<pid>/mountinfo``, ``vgpu.monitor.mounts``): the runtime's mount, which the
tenant cannot change. Each folder is read once (kept by path and inode: a folder made again is
read again); a container whose processes have not started yet is read again on the next walk.
``populated 0`` in its ``cgroup.events`` marks a container whose processes all ended: its cgroup
goes next.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from vgpu.monitor.cgroup import parse_path
from vgpu.monitor.mounts import device_of, process_grant

MAX_DEPTH = 12  # kubepods.slice/kubepods-burstable.slice/...pod.slice/cri-containerd-x.scope is 4
# the folders that hold containers' folders, at any depth: the kubelet's (kubepods, its QoS classes
# and pods, both drivers' names), containerd's own (k8s.io), Docker's; a host's other folders
# (user.slice, a service's) are not walked into
_CONTAINER = re.compile(r"(?:^|-)[0-9a-f]{64}(?:\.scope)?$")  # a name parse_path may take for one
_PARENT = re.compile(r"^(kubepods.*|pod.*|burstable|besteffort|guaranteed|k8s\.io|docker|system\.slice)$")


@dataclass(frozen=True)
class CgroupContainer:
    """A container's cgroup folder (its full path, as NVML's ``nameSpace`` wants it) and its grant."""

    folder: str
    grant: str
    populated: bool  # a process is still in it (or below it)


def _first_pid(folder: str, depth: int = 2) -> int | None:
    """A process of the cgroup: its own ``cgroup.procs``, else a child folder's (cgroup v2 keeps
    processes out of a folder with children that have controllers on)."""
    try:
        with open(os.path.join(folder, "cgroup.procs")) as procs:
            for line in procs:
                if line.strip().isdigit():
                    return int(line)
        if depth:
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        pid = _first_pid(entry.path, depth - 1)
                        if pid is not None:
                            return pid
    except OSError:
        pass
    return None


def _populated(folder: str) -> bool:
    try:
        fd = os.open(folder + "/cgroup.events", os.O_RDONLY | os.O_CLOEXEC)  # every pass: no text I/O
    except FileNotFoundError:
        return os.path.isdir(folder) and _first_pid(folder) is not None  # no cgroup.events (not v2)
    except OSError:
        return False
    try:
        data = os.read(fd, 256)
    except OSError:
        return False  # gone
    finally:
        os.close(fd)
    found = data.find(b"populated ")
    return found < 0 or data[found + 10 : found + 11] != b"0"


def unified_root(root: Path) -> Path | None:
    """The cgroup v2 hierarchy under ``root`` (the monitor's cgroup folder): ``root`` itself, or its
    ``unified`` folder on a hybrid host; recognised by ``cgroup.controllers`` in it or in a folder
    below it (the chart mounts only the kubelet's part, ``kubepods.slice``, there). None: v1 only."""
    if (root / "unified" / "cgroup.controllers").exists():
        return root / "unified"  # a hybrid host: v1 controllers beside it
    try:
        if (root / "cgroup.controllers").exists() or any(
            (c / "cgroup.controllers").exists() for c in root.iterdir() if c.is_dir()
        ):
            return root
    except OSError:
        pass
    return None


class CgroupScan:
    """``scan()``: every container under ``root`` that runs under a grant of ``grants_dir``."""

    def __init__(self, root: Path | None, grants_dir: Path, proc: Path = Path("/proc")) -> None:
        self.root = root  # None: no cgroup v2 hierarchy to walk (the driver caps v2 only)
        self.grants_dir = grants_dir
        self.proc = proc
        self._known: dict[str, tuple[int, str | None]] = {}  # folder -> (inode, grant; None: none)
        self._device: tuple[int, int] | None = None

    def _grant(self, folder: str, inode: int) -> str | None:
        known = self._known.get(folder)
        if known is not None and known[0] == inode:
            return known[1]
        pid = _first_pid(folder)
        if pid is None:
            return None  # not started yet (or ended before we saw it): read again next walk
        if self._device is None:
            self._device = device_of(self.grants_dir)
        try:
            grant = process_grant(pid, self.proc, self._device)
        except OSError:
            return None  # the process ended: read again next walk
        self._known[folder] = (inode, grant)
        return grant

    def scan(self) -> list[CgroupContainer]:
        found: list[CgroupContainer] = []
        seen: set[str] = set()
        if self.root is None:
            return found
        root = str(self.root)
        stack: list[tuple[str, int]] = [(root, 0)]
        while stack:
            folder, depth = stack.pop()
            try:
                with os.scandir(folder) as entries:
                    subs = [(e.path, e.inode()) for e in entries if e.is_dir(follow_symlinks=False)]
            except OSError:
                continue
            for path, inode in subs:
                name = path[path.rfind("/") + 1 :]
                known = self._known.get(path)
                if known is not None and known[0] == inode:  # a container seen before
                    seen.add(path)
                    if known[1] is not None:
                        found.append(CgroupContainer(path, known[1], _populated(path)))
                    continue
                ref = parse_path(path[len(root) :]) if _CONTAINER.search(name) else None
                if ref is None or ref.container_id not in name:
                    if depth < MAX_DEPTH and _PARENT.match(name):
                        stack.append((path, depth + 1))
                    continue
                seen.add(path)
                grant = self._grant(path, inode)
                if grant is not None:
                    found.append(CgroupContainer(path, grant, _populated(path)))
        self._known = {k: v for k, v in self._known.items() if k in seen}
        return sorted(found, key=lambda c: c.folder)
