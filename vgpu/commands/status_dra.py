"""``vgpu status`` for DRA nodes: the cards from the nodes' ResourceSlices and the shares from the
allocated ResourceClaims (docs/dra.md), in the same per-card form as the device plugin's nodes.

A DRA node publishes one ResourceSlice of driver ``vgpu.openaios.io`` (pool = the node's name;
a node with MIG cards, several: docs/mig.md#mig-with-dra, each MIG card shown once, a claim on a
placement as a share of it), one device per healthy card with the attributes ``uuid``,
``productName``, ``index`` and the capacities ``memory`` (bytes) and ``cores`` (100). A claim's
allocation names the pool and device of each request and, where the card is shared (consumable
capacity, 1.36), what it consumes; a claim allocated without ``consumedCapacity`` (1.34 and 1.35)
holds the whole card. The pods a claim serves are its ``status.reservedFor``. Anything malformed
is skipped: status never fails on what a cluster holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vgpu.commands.status_model import CardStatus, NodeStatus, Share
from vgpu.core import draslice as shape
from vgpu.core.claimconfig import DRIVER as DRA_DRIVER
from vgpu.core.draslice import MIB, attribute, capacity
from vgpu.core.errors import RequestError
from vgpu.core.gpumode import DRA
from vgpu.core.quantity import parse_quantity

SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"
CLAIMS_PATH = "/apis/resource.k8s.io/v1/resourceclaims"


def _quantity(value: Any) -> int | None:
    try:
        return parse_quantity(value, "capacity")
    except RequestError:
        return None


def dra_cards(slices: Iterable[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """node -> device name -> {index, uuid, model, memory_mib, cores, mode} of the driver's slices
    (mode: the share's attribute sharing, ``timeslice`` where absent, or ``mig``)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for s in slices:
        spec = s.get("spec") or {}
        node = spec.get("nodeName")
        if spec.get("driver") != DRA_DRIVER or not isinstance(node, str):
            continue
        for d in spec.get("devices") or []:
            if attribute(d, shape.TYPE, "string") == shape.MIG_TYPE:
                _mig_device(out.setdefault(node, {}), d)
                continue
            memory, cores = capacity(d, shape.MEMORY), capacity(d, shape.CORES_CAPACITY)
            if not isinstance(d.get("name"), str) or memory is None:
                continue
            index = attribute(d, shape.INDEX, "int")
            out.setdefault(node, {})[d["name"]] = {
                "index": index if isinstance(index, int) else -1,
                "uuid": str(attribute(d, shape.UUID, "string") or ""),
                "model": str(attribute(d, shape.PRODUCT, "string") or ""),
                "memory_mib": memory // MIB,
                "cores": cores if cores is not None else shape.CORES,
                "mode": str(attribute(d, shape.SHARING, "string") or "timeslice"),
            }
    return out


def _mig_device(cards: dict[str, dict[str, Any]], d: dict[str, Any]) -> None:
    """A MIG placement (docs/mig.md#mig-with-dra): its card once (``gpu-<parentIndex>``, its memory
    the whole card's slices), and the placement itself, marked ``slice_of`` that card, for the
    claims allocated on it (the slice's memory and compute share)."""
    index, memory = attribute(d, shape.PARENT_INDEX, "int"), capacity(d, shape.MEMORY)
    if not isinstance(d.get("name"), str) or not isinstance(index, int) or memory is None:
        return
    compute = attribute(d, shape.COMPUTE_SLICES, "int")
    parent = shape.device_name(index)
    entry = {
        "index": index,
        "uuid": str(attribute(d, shape.PARENT_UUID, "string") or ""),
        "model": f"{attribute(d, shape.PRODUCT, 'string') or ''} (MIG)",
        "memory_mib": memory // MIB,
        "cores": shape.CORES,
        "mode": shape.MIG_TYPE,
    }
    card = cards.setdefault(parent, entry)
    card["memory_mib"] = max(card["memory_mib"], memory // MIB)
    share = compute * 100 // 7 if isinstance(compute, int) else 100
    cards[d["name"]] = {**entry, "cores": share, "slice_of": parent}


def dra_shares(claims: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each allocated request of the driver as {node, device, namespace, claim, request, pods,
    memory_mib, cores}; memory_mib/cores None where the claim holds the whole card."""
    out: list[dict[str, Any]] = []
    for claim in claims:
        meta = claim.get("metadata") or {}
        status = claim.get("status") or {}
        results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
        pods = sorted(
            str(r.get("name", ""))
            for r in status.get("reservedFor") or []
            if isinstance(r, dict) and r.get("resource") == "pods"
        )
        for r in results:
            if not isinstance(r, dict) or r.get("driver") != DRA_DRIVER:
                continue
            consumed = r.get("consumedCapacity") or {}
            memory = _quantity(consumed[shape.MEMORY]) if shape.MEMORY in consumed else None
            cores = _quantity(consumed[shape.CORES_CAPACITY]) if shape.CORES_CAPACITY in consumed else None
            out.append(
                {
                    "node": str(r.get("pool", "")),
                    "device": str(r.get("device", "")),
                    "namespace": str(meta.get("namespace", "")),
                    "claim": str(meta.get("name", "")),
                    "request": str(r.get("request", "")),
                    "pods": pods,
                    "memory_mib": None if memory is None else -(-memory // MIB),
                    "cores": cores,
                }
            )
    return out


def add_dra(out: dict[str, NodeStatus], slices: list[dict[str, Any]], claims: list[dict[str, Any]]) -> None:
    """DRA nodes from their ResourceSlices, with each allocated claim's share on its card."""
    devices = dra_cards(slices)
    for node, cards in devices.items():
        out[node] = NodeStatus(node, "", mode=DRA)
        out[node].cards = [
            CardStatus(
                c["index"], c["uuid"], c["model"], c["memory_mib"], c["cores"], 0, True, mode=c["mode"]
            )
            for c in sorted(cards.values(), key=lambda c: c["index"])
            if "slice_of" not in c  # a MIG placement: its card is listed once
        ]
    for share in dra_shares(claims):
        node_status = out.get(share["node"])
        card = devices.get(share["node"], {}).get(share["device"])
        if node_status is None or card is None:
            continue
        target = next(c for c in node_status.cards if c.uuid == card["uuid"])
        held = Share(
            namespace=share["namespace"],
            pod=",".join(share["pods"]),
            container="",
            memory_mib=share["memory_mib"] if share["memory_mib"] is not None else card["memory_mib"],
            cores=share["cores"] if share["cores"] is not None else card["cores"],
            phase="reserved" if share["pods"] else "allocated",
            claim=f"{share['claim']}/{share['request']}",
        )
        target.shares.append(held)
        target.memory_used_mib += held.memory_mib
        target.cores_used += held.cores
        target.vgpus_used += 1
