"""MIG cards as KEP-4815 partitionable devices: the pool's extra ResourceSlices, pure.

A card in MIG mode on a node whose DRA plugin runs with ``--mig dynamic`` is not offered as one
shared device (vgpu/dra/slices.py) but as a *counter set* and one device per profile placement:

- the counter set ``gpu-<index>-mig`` holds the card's eight memory slices as counters
  ``memory-slice-0`` .. ``memory-slice-7`` (1 each), its seven compute slices
  (``compute-slices``: 7) and its one set of media extensions (``media-extensions``: 1);
- the device ``gpu-<index>-mig-<profile>-<start>`` (``1g.10gb+me`` at 3:
  ``gpu-0-mig-1g-10gb-me-3``) consumes, from that set, each memory slice it covers, its compute
  slices, and the media extensions when it has them (the ``+me`` profiles and the whole card).

The scheduler's allocator subtracts what allocated devices consume, so it never gives two claims
overlapping placements, more compute slices than the card has, or two ``+me`` slices: the
driver's placement rules (vgpu/core/mig.py) are what the counters say.

The 1.36 API's limits shape the pool (``resource.k8s.io/v1``, checked by the API server): a
slice holds either devices or shared counters, never both; at most 8 counter sets per slice; at
most 64 devices in a slice where a device consumes counters; at most 32 counters per set. So the
pool of a node is: its shared-card slice (vgpu/dra/slices.py, the cards not in MIG mode), one
counters slice per 8 MIG cards (``<node>-vgpu.openaios.io-counters-<n>``), and one devices slice
per MIG card (``<node>-vgpu.openaios.io-gpu-<index>``, 25 devices on an H100 or H200), every slice
at the same pool generation and ``resourceSliceCount``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vgpu.core import draslice as shape
from vgpu.core.claimconfig import DRIVER
from vgpu.core.draslice import MIB, MIG_TYPE
from vgpu.core.errors import VgpuError
from vgpu.core.mig import COMPUTE_SLICES, MEMORY_SLICES, MigTable, Placement, Profile
from vgpu.core.quantity import parse_quantity
from vgpu.dra.slices import semver
from vgpu.node.discovery import Card

COMPUTE_COUNTER = "compute-slices"
MEDIA_COUNTER = "media-extensions"
COUNTER_SETS_PER_SLICE = 8
DEVICES_PER_SLICE = 64  # where a device consumes counters
# The DeviceClasses (charts/vgpu/templates/dra-deviceclass.yaml): shares of whole time-sliced cards
# (a device with no attribute sharing counts as one: slices of older plugins), shares of cards
# shared through MPS (MPS_CLASS), MIG slices.
_SHARING = f'device.attributes["{DRIVER}"].{shape.SHARING}'
SHARED_SELECTOR = (
    f'device.driver == "{DRIVER}" && device.allowMultipleAllocations'
    f' && (!has({_SHARING}) || {_SHARING} == "timeslice")'
)
MPS_SELECTOR = (
    f'device.driver == "{DRIVER}" && device.allowMultipleAllocations'
    f' && has({_SHARING}) && {_SHARING} == "mps"'
)
MIG_CLASS = f"mig.{DRIVER}"
MIG_SELECTOR = f'device.driver == "{DRIVER}" && !device.allowMultipleAllocations'


def memory_counter(i: int) -> str:
    return f"memory-slice-{i}"


def counter_set_name(index: int) -> str:
    return f"gpu-{index}-mig"


def device_name(index: int, profile: str, start: int) -> str:
    """A DNS label: ``1g.10gb+me`` on card 0 at slice 3 is ``gpu-0-mig-1g-10gb-me-3``."""
    return f"gpu-{index}-mig-{profile.replace('.', '-').replace('+', '-')}-{start}"


def _named(base: str, suffix: str) -> str:
    """``base`` + ``suffix`` cut to a slice name's 253 characters (a long node name)."""
    return base[: 253 - len(suffix)] + suffix


def counters_slice_name(base: str, n: int) -> str:
    return _named(base, f"-counters-{n}")


def devices_slice_name(base: str, index: int) -> str:
    return _named(base, f"-gpu-{index}")


@dataclass(frozen=True)
class MigSlot:
    """One device of the pool: a profile's placement on a card."""

    device: str
    card: Card
    profile: Profile
    placement: Placement

    @property
    def memory_mib(self) -> int:
        return self.profile.memory_mib


def consumes(profile: Profile, start: int) -> dict[str, str]:
    """What a GI of ``profile`` at ``start`` takes from its card's counter set."""
    used = {memory_counter(s): "1" for s in Placement(start, profile.memory_slices).slices}
    used[COMPUTE_COUNTER] = str(profile.compute_slices)
    if profile.media_extensions or profile.ofas > 0:
        used[MEDIA_COUNTER] = "1"
    return used


def counter_set(index: int) -> dict[str, Any]:
    counters = {memory_counter(s): {"value": "1"} for s in range(MEMORY_SLICES)}
    counters[COMPUTE_COUNTER] = {"value": str(COMPUTE_SLICES)}
    counters[MEDIA_COUNTER] = {"value": "1"}
    return {"name": counter_set_name(index), "counters": counters}


def slots(card: Card, table: MigTable, blocked: Iterable[Placement] = ()) -> list[MigSlot]:
    """Every placement of every profile of the card, less those overlapping ``blocked`` (GPU
    instances on the card that no prepared claim holds: another's, or waiting to be reclaimed).
    A profile's placements go highest start first: the allocator takes the first free device, and
    small slices from the top keep the low starts for the large profiles (the driver's own habit)."""
    taken = [*blocked]
    return [
        MigSlot(device_name(card.index, p.name, pl.start), card, p, pl)
        for p in table.profiles
        for pl in sorted(p.placements, key=lambda pl: -pl.start)  # the highest first: the allocator
        if not any(pl.overlaps(b) for b in taken)
    ]


def device(slot: MigSlot, driver_version: str = "") -> dict[str, Any]:
    card, p = slot.card, slot.profile
    attributes: dict[str, Any] = {
        shape.TYPE: {"string": MIG_TYPE},
        "profile": {"string": p.name},
        shape.PARENT_UUID: {"string": card.uuid},
        shape.PARENT_INDEX: {"int": card.index},
        shape.PRODUCT: {"string": card.model},
        "placementStart": {"int": slot.placement.start},
        "placementSize": {"int": slot.placement.size},
        shape.COMPUTE_SLICES: {"int": p.compute_slices},
        "memorySlices": {"int": p.memory_slices},
        "mediaExtensions": {"bool": p.media_extensions},
    }
    capability = semver(card.compute_capability)
    if capability is not None:
        attributes[shape.COMPUTE_CAPABILITY] = {"version": capability}
    version = semver(driver_version)
    if version is not None:
        attributes[shape.DRIVER_VERSION] = {"version": version}
    return {
        "name": slot.device,
        "attributes": attributes,
        "capacity": {
            shape.MEMORY: {"value": str(p.memory_mib * MIB)},
            "multiprocessors": {"value": str(p.sms)},
        },
        "consumesCounters": [
            {
                "counterSet": counter_set_name(card.index),
                "counters": {k: {"value": v} for k, v in consumes(p, slot.placement.start).items()},
            }
        ],
    }


def _slice(name: str, node: str, spec: dict[str, Any], owner: list[dict[str, Any]] | None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if owner:
        metadata["ownerReferences"] = owner
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": metadata,
        "spec": {"driver": DRIVER, "nodeName": node, **spec},
    }


def mig_slices(
    base: str,
    node: str,
    cards: Sequence[tuple[Card, list[MigSlot]]],
    driver_version: str = "",
    owner: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The pool's slices for its MIG cards (each with the slots it offers: none for an unhealthy
    card), without ``spec.pool`` (the publisher sets it on every slice of the pool)."""
    ordered = sorted(cards, key=lambda c: c[0].index)
    out: list[dict[str, Any]] = []
    for n in range(0, len(ordered), COUNTER_SETS_PER_SLICE):
        group = ordered[n : n + COUNTER_SETS_PER_SLICE]
        out.append(
            _slice(
                counters_slice_name(base, n // COUNTER_SETS_PER_SLICE),
                node,
                {"sharedCounters": [counter_set(c.index) for c, _ in group]},
                owner,
            )
        )
    for card, offered in ordered:
        if len(offered) > DEVICES_PER_SLICE:
            raise VgpuError(f"card {card.uuid} has {len(offered)} MIG placements, more than a slice holds")
        devices = [device(s, driver_version) for s in offered] if card.healthy else []
        out.append(_slice(devices_slice_name(base, card.index), node, {"devices": devices}, owner))
    return out


def fingerprint(slice_obj: dict[str, Any] | None) -> tuple[Any, ...] | None:
    """What a MIG slice offers, quantities read as values (the API server rewrites them): its
    counter sets and its devices with what they consume. None for no slice or a malformed one."""
    if not slice_obj:
        return None
    spec = slice_obj.get("spec") or {}
    try:

        def counters(m: dict[str, Any]) -> tuple[tuple[str, int], ...]:
            return tuple(sorted((k, parse_quantity(v["value"], k)) for k, v in m.items()))

        sets = tuple((s["name"], counters(s["counters"])) for s in spec.get("sharedCounters") or [])
        devices = tuple(
            (
                d["name"],
                d["attributes"]["profile"]["string"],
                d["attributes"][shape.PARENT_UUID]["string"],
                tuple((c["counterSet"], counters(c["counters"])) for c in d["consumesCounters"]),
            )
            for d in spec.get("devices") or []
        )
    except (KeyError, TypeError, AttributeError, VgpuError):
        return None
    return (spec.get("driver"), spec.get("nodeName"), sets, devices)
