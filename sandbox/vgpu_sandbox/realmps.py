"""The real node's cards shared through MPS (``vgpu sandbox up --real-node --sharing-mode mps``).

The chart's device plugin runs one ``nvidia-cuda-mps-control`` daemon per MPS card and looks for
that tool where the driver's tools are: under its driver root (the chart's ``driver.root``,
mounted at ``/driver-root`` in its pod) in the driver's bin folders, else on its PATH
(vgpu/node/mps.py ``find_control``). The real node has no driver, so the sandbox gives the
plugin a stub driver root of its own, ``<sandbox>/real-node/driver``, holding one executable,
``usr/bin/nvidia-cuda-mps-control``: a wrapper that runs the fake daemon of the plugin's own
image (``python3 -m vgpu.node.fake_mps``, vgpu/node/fake_mps.py). The plugin puts the tool's
folder first on the daemon's PATH, which is why the root holds nothing else: ``python3`` is then
the image's (``/opt/vgpu/bin``, where ``vgpu`` is installed), never a host's.

The daemons' pipe and log folders are the host's (``/var/lib/vgpu/mps/<uuid>``, vgpu/node/paths.py),
which the plugin leaves behind; ``down`` removes those of the node's cards (:func:`forget`).

The node's sharing mode is set for this node alone (``devicePlugin.nodeOverrides``), as an
operator turns MPS on for some nodes of a cluster (docs/mps.md).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from vgpu.node.paths import HostPaths

CONTROL = "nvidia-cuda-mps-control"
WRAPPER = (
    "#!/bin/sh\n"
    "# the fake MPS control daemon of the device plugin's image (vgpu_sandbox.realmps)\n"
    'exec python3 -m vgpu.node.fake_mps "$@"\n'
)


def driver_root(node_root: Path) -> Path:
    """The stub driver root under the real node's folder (``NodeLayout.root``)."""
    return node_root / "driver"


def control_tool(node_root: Path) -> Path:
    return driver_root(node_root) / "usr" / "bin" / CONTROL


def write_driver_root(node_root: Path) -> Path:
    """The stub driver root with the wrapper in ``usr/bin``, readable and runnable by the plugin's
    pod; returns the wrapper's path."""
    tool = control_tool(node_root)
    tool.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    for folder in (driver_root(node_root), driver_root(node_root) / "usr", tool.parent):
        folder.chmod(0o755)
    tool.write_text(WRAPPER)
    tool.chmod(0o755)
    return tool


def chart_values(node_root: Path, node: str) -> dict[str, Any]:
    """What the chart needs to run ``node``'s device plugin in MPS mode with the stub's tool."""
    return {
        "driver": {"root": str(driver_root(node_root))},
        "devicePlugin": {"nodeOverrides": [{"name": node, "sharingMode": "mps"}]},
    }


def card_folders(uuids: list[str]) -> list[str]:
    """Each MPS card's folder on the host (its daemon's pipe and log folders), for the node's record."""
    return [str(HostPaths(Path("/")).mps_dir / uuid) for uuid in uuids]


def forget(folders: list[str]) -> None:
    """Remove the cards' folders at ``down``, once the plugin and its daemons are gone."""
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
