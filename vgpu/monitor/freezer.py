"""The cgroup freezer of a container, found from one of its processes, for the compute throttle.

``enforcement.compute: throttle`` holds a container whose launches do not pass through the hook
(``vgpu.monitor.compute``) by freezing its cgroup for part of the time: cgroup v2
``cgroup.freeze`` (``1`` frozen, ``0`` thawed) or cgroup v1 ``freezer.state`` (``FROZEN``,
``THAWED``). Which one: the hierarchy in the process's ``/proc/<pid>/cgroup`` whose path names
its container (``vgpu.monitor.cgroup.parse_path``), the unified one (``0::``) or the v1
``freezer`` controller's, so a hybrid host (v1 controllers and a unified hierarchy beside them)
is read right.

The cgroup file system is looked for at ``/host/sys/fs/cgroup``, else ``/sys/fs/cgroup``. The
chart mounts there, when ``enforcement.compute`` is ``throttle``, only the kubelet's part of the
host's cgroups (``devicePlugin.hostPaths.podCgroups``: ``/sys/fs/cgroup/kubepods.slice`` at
``/host/sys/fs/cgroup/kubepods.slice``, say), so a hierarchy is also recognised by a folder below it
that holds its marker. A reader in its own cgroup namespace sees other containers' paths with leading
``/..`` parts; the rest of such a path (which ends in the pod's and the container's own folders) is looked
for a few levels below the root.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vgpu.monitor.cgroup import parse_path

ROOTS = (Path("/host/sys/fs/cgroup"), Path("/sys/fs/cgroup"))
_V2 = ("cgroup.freeze", "1", "0")
_V1 = ("freezer.state", "FROZEN", "THAWED")


class FreezerError(OSError):
    """No freezer can be found or written for a container; the message says why."""


@dataclass(frozen=True)
class Freezer:
    """One container's freezer file."""

    file: Path
    frozen_word: str
    thawed_word: str

    def freeze(self) -> None:
        self.file.write_text(self.frozen_word)

    def thaw(self) -> None:
        self.file.write_text(self.thawed_word)


def cgroup_root(roots: tuple[Path, ...] = ROOTS) -> Path:
    for root in roots:
        if root.is_dir():
            return root
    return roots[-1]


def _has(base: Path, marker: str) -> bool:
    """``base`` is a hierarchy's root: it holds ``marker``, or a folder below it does (the pods'
    part of the hierarchy, kubepods.slice say, mounted alone at its own path)."""
    if (base / marker).exists():
        return True
    try:
        return any((c / marker).exists() for c in base.iterdir() if c.is_dir())
    except OSError:
        return False


def _mounts(root: Path) -> list[tuple[Path, tuple[str, str, str]]]:
    """Where to look, in order: the unified hierarchy and the v1 freezer, as mounted under ``root``."""
    found = []
    for base, kind in ((root, _V2), (root / "unified", _V2), (root / "freezer", _V1)):
        marker = "cgroup.controllers" if kind is _V2 else "freezer.state"
        if _has(base, marker) or (kind is _V1 and base.is_dir()):
            found.append((base, kind))
    return found


def _locate(base: Path, path: str) -> Path | None:
    parts = [p for p in path.split("/") if p]
    if ".." not in parts:
        folder = base.joinpath(*parts)
        return folder if folder.is_dir() else None
    rest = [p for p in parts if p != ".."]
    for depth in range(0, 5):  # in a cgroup namespace: the rest lies some levels below the root
        for folder in base.glob("/".join(["*"] * depth + rest)):
            if folder.is_dir():
                return folder
    return None


def freezer_of(pid: int, proc: Path = Path("/proc"), root: Path | None = None) -> Freezer:
    """The freezer of the container ``pid`` runs in; raises FreezerError naming what is missing."""
    root = root if root is not None else cgroup_root()
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError as err:
        raise FreezerError(f"cannot read {proc}/{pid}/cgroup ({err.strerror})") from err
    lines: list[tuple[str, list[str], str]] = []
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        names, _, path = rest.partition(":")
        if parse_path(path) is not None:
            lines.append((hierarchy, names.split(","), path))
    if not lines:
        raise FreezerError(f"process {pid} is in no container's cgroup")
    for base, (name, frozen, thawed) in _mounts(root):
        for hierarchy, controllers, path in lines:
            v2 = name == "cgroup.freeze"
            if (v2 and hierarchy == "0" and controllers == [""]) or (not v2 and "freezer" in controllers):
                folder = _locate(base, path)
                if folder is not None and (folder / name).exists():
                    return Freezer(folder / name, frozen, thawed)
    raise FreezerError(
        f"no cgroup freezer found under {root} for process {pid} ({lines[0][2]}); mount the host's "
        "cgroup folder of the kubelet's pods at the same path under /host (the chart does with "
        "enforcement.compute: throttle: set devicePlugin.hostPaths.podCgroups to the node's, e.g. "
        "/sys/fs/cgroup/kubepods for the cgroupfs driver, /sys/fs/cgroup/freezer/kubepods on cgroup v1)"
    )
