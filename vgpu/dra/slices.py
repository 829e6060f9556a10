"""The node's cards as a ``resource.k8s.io/v1`` ResourceSlice: a pure function of the inventory.

One slice per node holds the whole pool (pool name = node name, ``resourceSliceCount: 1``), one
device per healthy card, named ``gpu-<index>``, with the attributes and capacities of the DRA
names (docs/dra.md#the-node-plugin): several claims may share a card
(``allowMultipleAllocations``), each consuming part of its ``memory`` (bytes, whole MiB) and
``cores`` (percent), and carrying the card's mode as the attribute ``sharing`` (``timeslice``, or
``mps`` under ``--sharing-mode mps``: docs/dra.md#mps-shares). ``vgpu dra-plugin`` publishes it
(vgpu/dra/publish.py); the benchmark builds slices of simulated nodes with the same function.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from fractions import Fraction
from typing import Any

from vgpu.core import draslice as shape
from vgpu.core.claimconfig import DRIVER, SHARINGS
from vgpu.core.draslice import CORES, MIB, SHARING, device_name
from vgpu.core.errors import VgpuError
from vgpu.core.quantity import parse_quantity
from vgpu.node.discovery import Card

API_VERSION = "resource.k8s.io/v1"
# A claim that names no memory gets 1 GiB of the card, one that names no cores the whole card's
# compute (100: no SM cap); a card is shared only between claims that each ask for cores.
DEFAULT_MEMORY = "1Gi"
DEFAULT_MEMORY_BYTES = 1 << 30
DEFAULT_CORES = 100
_NUMBERS = re.compile(r"^[0-9]+(\.[0-9]+)*$")


def slice_name(node: str) -> str:
    """The node's one slice: a DNS subdomain of at most 253 characters (a node name is one)."""
    name = f"{node}-{DRIVER}"
    return name if len(name) <= 253 else node[: 253 - len(DRIVER) - 1] + "-" + DRIVER


def semver(version: str) -> str | None:
    """``570.124.06`` as semantic version ``570.124.6`` (no leading zeros; two parts get ``.0``,
    a fourth is dropped); None for no version or text that is not dotted numbers."""
    if not _NUMBERS.match(version or ""):
        return None
    parts = [str(int(p)) for p in version.split(".")][:3]
    while len(parts) < 3:
        parts.append("0")
    return ".".join(parts)


def memory_bytes(card: Card, memory_scaling: float = 1.0) -> int:
    """The card's device memory as the node offers it: scaled as the device plugin's inventory
    scales it (contract 2), in whole MiB."""
    return int(card.memory_mib * Fraction(repr(memory_scaling))) * MIB


def device(
    card: Card, driver_version: str = "", memory_scaling: float = 1.0, sharing: str = SHARINGS[0]
) -> dict[str, Any]:
    """One card as a slice's device, shared as ``sharing`` says (``timeslice`` or ``mps``)."""
    attributes: dict[str, Any] = {
        shape.UUID: {"string": card.uuid},
        SHARING: {"string": sharing},
        shape.PRODUCT: {"string": card.model},
        shape.INDEX: {"int": card.index},
        shape.NUMA: {"int": card.numa if card.numa >= 0 else -1},
    }
    capability = semver(card.compute_capability)
    if capability is not None:
        attributes[shape.COMPUTE_CAPABILITY] = {"version": capability}
    version = semver(driver_version)
    if version is not None:
        attributes[shape.DRIVER_VERSION] = {"version": version}
    total = memory_bytes(card, memory_scaling)
    return {
        "name": device_name(card.index),
        "attributes": attributes,
        "capacity": {
            shape.MEMORY: {
                "value": str(total),
                "requestPolicy": {
                    # the API server refuses a default past the range's max (a card under 1 GiB)
                    "default": DEFAULT_MEMORY if total >= DEFAULT_MEMORY_BYTES else str(total),
                    "validRange": {"min": "1Mi", "max": str(total), "step": "1Mi"},
                },
            },
            shape.CORES_CAPACITY: {
                "value": str(CORES),
                "requestPolicy": {
                    "default": str(DEFAULT_CORES),
                    "validRange": {"min": "1", "max": str(CORES), "step": "1"},
                },
            },
        },
        "allowMultipleAllocations": True,
    }


def build_slice(
    node: str,
    cards: Iterable[Card],
    generation: int,
    driver_version: str = "",
    memory_scaling: float = 1.0,
    node_uid: str | None = None,
    sharing: str = SHARINGS[0],
) -> dict[str, Any]:
    """The node's ResourceSlice: its healthy cards, in index order, at pool ``generation``.

    With ``node_uid`` the slice is owned by the Node, so the garbage collector removes it with
    the Node (never earlier: a plugin that restarts leaves it in place)."""
    metadata: dict[str, Any] = {"name": slice_name(node)}
    if node_uid:
        metadata["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid, "controller": True}
        ]
    healthy = sorted((c for c in cards if c.healthy), key=lambda c: c.index)
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": metadata,
        "spec": {
            "driver": DRIVER,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "nodeName": node,
            "devices": [device(c, driver_version, memory_scaling, sharing) for c in healthy],
        },
    }


def fingerprint(slice_obj: dict[str, Any] | None) -> tuple[Any, ...] | None:
    """What a slice offers, in a form that survives the API server's rewriting of quantities
    (``"1073741824"`` comes back as ``"1Gi"``): per device its name, UUID, mode, memory and cores;
    the node and pool. None for no slice or one this module could not have written."""
    if not slice_obj:
        return None
    spec = slice_obj.get("spec") or {}
    try:
        devices = tuple(
            (
                d["name"],
                d["attributes"][shape.UUID]["string"],
                (d["attributes"].get(SHARING) or {}).get("string"),
                parse_quantity(d["capacity"][shape.MEMORY]["value"], "memory"),
                parse_quantity(d["capacity"][shape.CORES_CAPACITY]["value"], "cores"),
            )
            for d in spec.get("devices") or []
        )
    except (KeyError, TypeError, VgpuError):
        return None
    return (spec.get("driver"), spec.get("nodeName"), (spec.get("pool") or {}).get("name"), devices)
