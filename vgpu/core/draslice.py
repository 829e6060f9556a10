"""The shape of a card as a device of the DRA driver's ResourceSlice, in one home: the names the
node plugin writes (vgpu/dra/slices.py, vgpu/dra/migslices.py) and ``vgpu status`` reads
(vgpu/commands/status_dra.py), and the readers of a device as the API server returns it.

A shared card is the device ``gpu-<index>`` with the attributes of ATTRIBUTES and the consumable
capacities ``memory`` (bytes) and ``cores`` (percent of the card's compute, 100), shared by
several claims (``allowMultipleAllocations``). A MIG placement (docs/mig.md#mig-with-dra) carries
``type: mig``, its card's ``parentUUID`` and ``parentIndex``, and ``computeSlices``.
docs/dra.md#the-node-plugin says what each is for and what it costs kube-scheduler.
"""

from __future__ import annotations

from typing import Any

from vgpu.core.errors import RequestError
from vgpu.core.quantity import parse_quantity

MIB = 1 << 20
CORES = 100  # a card's compute, as the capacity ``cores``

# attributes of a shared card (each in the driver's domain: device.attributes["vgpu.openaios.io"])
UUID = "uuid"
SHARING = "sharing"  # the card's mode, one of claimconfig.SHARINGS (absent: timeslice, older slices)
PRODUCT = "productName"
INDEX = "index"
NUMA = "numaNode"
COMPUTE_CAPABILITY = "computeCapability"
DRIVER_VERSION = "driverVersion"
# attributes of a MIG placement that status reads
TYPE = "type"
MIG_TYPE = "mig"
PARENT_UUID = "parentUUID"
PARENT_INDEX = "parentIndex"
COMPUTE_SLICES = "computeSlices"
# consumable capacities
MEMORY = "memory"
CORES_CAPACITY = "cores"


def device_name(index: int) -> str:
    """A shared card's device: ``gpu-<index>`` (also the MIG card's name in status)."""
    return f"gpu-{index}"


def attribute(device: dict[str, Any], name: str, kind: str) -> Any:
    """The value of attribute ``name`` of type ``kind`` (``string``, ``int``, ``version``,
    ``bool``), None where absent or of another type."""
    value = (device.get("attributes") or {}).get(name)
    return value.get(kind) if isinstance(value, dict) else None


def capacity(device: dict[str, Any], name: str) -> int | None:
    """The capacity ``name``'s value as an integer (the API server may write ``1Gi`` for
    ``1073741824``), None where absent or malformed."""
    entry = (device.get("capacity") or {}).get(name)
    if not isinstance(entry, dict):
        return None
    try:
        return parse_quantity(entry.get("value"), "capacity")
    except RequestError:
        return None
