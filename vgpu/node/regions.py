"""The containers' regions on the host, as the node reads them without the monitor: which
folders hold one, and the device memory each container holds (the device plugin's Lease)."""

from __future__ import annotations

from pathlib import Path

from vgpu.hookabi.region import Region, RegionError
from vgpu.node.paths import REGION_FILE_NAME


def region_dirs(containers_dir: Path) -> list[Path]:
    """The containers' folders that hold a region, sorted; none when the folder is not there yet.
    Raises OSError when it cannot be read."""
    try:
        folders = sorted(containers_dir.iterdir())
    except FileNotFoundError:
        return []
    return [folder for folder in folders if (folder / REGION_FILE_NAME).is_file()]


def region_usage(containers_dir: Path) -> dict[str, dict[str, int]]:
    """Device memory each container holds, per card: ``{"<pod-uid>_<container>": {uuid: bytes}}``.

    What the node's Lease carries for ``vgpu status``; unreadable regions are left out (the
    monitor's metrics report them)."""
    usage: dict[str, dict[str, int]] = {}
    for folder in region_dirs(containers_dir):
        try:
            with Region(folder / REGION_FILE_NAME, mapped=False) as region:
                snap = region.snapshot()
        except (RegionError, OSError):
            continue
        usage[folder.name] = {dev.uuid: int(dev.used_bytes) for dev in snap.devices if dev.uuid}
    return usage
