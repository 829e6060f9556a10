"""Every host path the plugin touches, under one root prefix (``--root``) so tests run in temp trees."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from vgpu.hookabi.grant import CONTAINERS_FOLDER, grant_path, grants_dir_of

log = logging.getLogger(__name__)

PLUGIN_SOCKET_NAME = "vgpu.sock"
KUBELET_SOCKET_NAME = "kubelet.sock"
REGION_FILE_NAME = "vgpu.region"
HOOK_LIBRARY_NAME = "libvgpu.so"
# The DRA plugin's region folders and grants are named dra_<claim-uid>_<request> (no pod UID).
DRA_PREFIX = "dra"
# Where the hook library appears inside a container; /etc/ld.so.preload names it.
CONTAINER_HOOK_PATH = "/usr/local/vgpu/" + HOOK_LIBRARY_NAME


@dataclass(frozen=True)
class HostPaths:
    root: Path

    @property
    def kubelet_dir(self) -> Path:
        return self.root / "var/lib/kubelet/device-plugins"

    @property
    def kubelet_socket(self) -> Path:
        return self.kubelet_dir / KUBELET_SOCKET_NAME

    @property
    def plugin_socket(self) -> Path:
        return self.kubelet_dir / PLUGIN_SOCKET_NAME

    @property
    def vgpu_dir(self) -> Path:
        return self.root / "var/lib/vgpu"

    @property
    def containers_dir(self) -> Path:
        return self.vgpu_dir / CONTAINERS_FOLDER

    @property
    def lib_dir(self) -> Path:
        return self.vgpu_dir / "lib"

    def container_dir(self, pod_uid: str, container: str) -> Path:
        return self.containers_dir / f"{pod_uid}_{container}"

    @property
    def mps_dir(self) -> Path:
        """MPS mode (docs/mps.md): one folder per card, ``<uuid>/pipe`` (the control daemon's
        sockets, mounted read-only into the card's containers) and ``<uuid>/log``; root's, 0755."""
        return self.vgpu_dir / "mps"

    def mps_pipe(self, uuid: str) -> Path:
        return self.mps_dir / uuid / "pipe"

    def mps_log(self, uuid: str) -> Path:
        return self.mps_dir / uuid / "log"

    @property
    def grants_dir(self) -> Path:
        """What the device plugin granted each container, kept out of the container's reach: the
        container's own folder is mounted writable into it, so its region's words are claims."""
        return grants_dir_of(self.vgpu_dir)

    def grant(self, folder_name: str) -> Path:
        """The container's grant (vgpu/hookabi/grant.py), mounted read-only into it."""
        return grant_path(self.grants_dir, folder_name)

    def priority_record(self, folder_name: str) -> Path:
        """The priority record of plugins before the grant (read for containers they started)."""
        return priority_record(self.grants_dir, folder_name)

    @staticmethod
    def container_dir_inside(pod_uid: str, container: str) -> str:
        """The same folder as the container sees it (mounted at its host path without the root)."""
        return f"/var/lib/vgpu/containers/{pod_uid}_{container}"


def priority_record(grants_dir: Path, folder_name: str) -> Path:
    """The granted priority of the container whose folder is ``containers/<folder_name>``, as
    plugins before the grant wrote it; the arbiter still reads it where a container has no grant."""
    return grants_dir / f"{folder_name}.priority"


def _entries(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []


def _stale(entry: Path, live_pod_uids: set[str], min_age_s: float, now: float) -> bool:
    """``entry`` (named ``<pod-uid>_...``) belongs to a pod gone from the node and is older than
    ``min_age_s``; a failing stat raises OSError. The DRA plugin's entries (``dra_<claim-uid>_...``)
    are never stale here: they go when the kubelet unprepares their claim (vgpu/dra/prepare.py)."""
    owner = entry.name.partition("_")[0]
    if owner == DRA_PREFIX:
        return False
    return owner not in live_pod_uids and now - entry.stat().st_mtime >= min_age_s


def sweep_container_dirs(
    paths: HostPaths, live_pod_uids: set[str], min_age_s: float, now: float
) -> list[Path]:
    """Remove the folders of containers whose pod is gone from the node, and their priority
    records; returns the folders removed.

    A folder younger than ``min_age_s`` stays even without a pod: Allocate creates it before the
    pod's status settles, and a listing may lag behind.
    """
    from vgpu.node import folders

    removed: list[Path] = []
    for folder in _entries(paths.containers_dir):
        try:
            if folder.is_dir() and _stale(folder, live_pod_uids, min_age_s, now):
                folders.remove(folder)
                removed.append(folder)
        except OSError as err:
            log.warning("cannot remove %s, whose pod left the node: %s (trying next sweep)", folder, err)
            continue
    for record in _entries(paths.grants_dir):  # a grant outlives its folder by nothing
        try:
            if _stale(record, live_pod_uids, min_age_s, now):
                record.unlink()
        except OSError:
            continue
    return removed
