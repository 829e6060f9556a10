"""How a container's cards reach it, by ``driverInject`` (docs/security.md, "Cards only through
the plugin"): never from the container's own environment, which its tenant writes.

- ``plugin``: the device nodes and the driver's libraries in Allocate's answer (vgpu/node/driver.py);
- ``cdi``: CDI device names ``<cdiKind>=<uuid>`` of the node's CDI spec (``nvidia-ctk cdi generate
  --device-name-strategy=uuid``), which the container runtime itself resolves;
- ``runtime``: NVIDIA's container toolkit, told the cards by volume mounts under
  :data:`VOLUME_MOUNT_DIR` (its ``accept-nvidia-visible-devices-as-volume-mounts``): a mount is
  made by kubelet from Allocate's answer, so a tenant cannot add one as it can set a variable
  (the toolkit's ``accept-nvidia-visible-devices-envvar-when-unprivileged`` off, which
  roles/gpu_node sets, refuses the variable).

``NVIDIA_VISIBLE_DEVICES`` stays in contract 4's environment for tools and the hook; with the
node set up as above it gives no card.
"""

from __future__ import annotations

from collections.abc import Sequence

# Where NVIDIA's toolkit reads a container's device list from mounts (its volume-mount strategy).
VOLUME_MOUNT_DIR = "/var/run/nvidia-container-devices"


def volume_mounts(uuids: Sequence[str]) -> list[tuple[str, str]]:
    """(container path, host path) of each card's volume mount (``runtime``): /dev/null, read-only."""
    return [(f"{VOLUME_MOUNT_DIR}/{uuid}", "/dev/null") for uuid in uuids]


def cdi_names(kind: str, uuids: Sequence[str]) -> list[str]:
    """The fully qualified CDI device names of the cards (``cdi``)."""
    return [f"{kind}={uuid}" for uuid in uuids]
