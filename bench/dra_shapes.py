"""The slice, class and claim shapes bench_dra.py places claim pods against (``--shapes``), so that
one run compares them interleaved on the same nodes.

- ``main``: what the DRA driver published before issue 38, kept here frozen: per card seven
  attributes (uuid, sharing, productName, index, numaNode, computeCapability, driverVersion),
  ``memory`` and ``cores`` with a ``requestPolicy`` each, and the chart's DeviceClass selector of
  then (driver, ``allowMultipleAllocations`` and the ``sharing`` attribute).
- ``current``: what ``vgpu dra-plugin`` publishes now (vgpu.dra.slices.build_slice) and the
  chart's DeviceClass ``vgpu.openaios.io`` as charts/vgpu/templates/dra-deviceclass.yaml writes it.
- ``bare``: the reduced case, for upstream's own cost: the same 8 shared devices per slice, with
  the two capacities and no policy, no attribute, and a class that selects on the driver only.
- ``plain``: a further reduced case: 8 devices per slice that are not shared (no capacity, no
  ``allowMultipleAllocations``), a driver-only class, and a claim for one device by count.
- ``main-driveronly``, ``main-nopolicy``, ``main-noattributes``: main with its class checking the
  driver only, without its request policies, with only the attribute ``sharing``: what each part
  of the shape costs the allocator (bench/dra_allocator).
- ``bare-nocel``, ``plain-nocel``: the two with a class of no selector at all (it would take any
  driver's device: a reduced case, never a product shape), for what the CEL evaluation costs.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vgpu.dra.slices import DRIVER, build_slice, slice_name
from vgpu.node.discovery import Card

CARD_MIB = 81920
MIB = 1 << 20
CHART_CLASSES = Path(__file__).resolve().parents[1] / "charts/vgpu/templates/dra-deviceclass.yaml"
MAIN_SELECTOR = (
    f'device.driver == "{DRIVER}" && device.allowMultipleAllocations && '
    f'(!has(device.attributes["{DRIVER}"].sharing) || device.attributes["{DRIVER}"].sharing == "timeslice")'
)
DRIVER_ONLY = f'device.driver == "{DRIVER}"'
SHARE_REQUEST = {"memory": "1000Mi", "cores": "10"}


def cards(node: str) -> list[Card]:
    return [
        Card(f"GPU-{node}-{k}", k, "NVIDIA A100", CARD_MIB, numa=k // 4, compute_capability="8.0")
        for k in range(8)
    ]


def chart_selector() -> str:
    """The first DeviceClass's CEL expression in the chart (the time-sliced shares' class)."""
    found = re.search(r"expression:\s*(.+)", CHART_CLASSES.read_text())
    if not found:
        raise SystemExit(f"{CHART_CLASSES}: no CEL expression found")
    return found.group(1).strip()


def _main_device(card: Card) -> dict[str, Any]:
    total = card.memory_mib * MIB
    return {
        "name": f"gpu-{card.index}",
        "attributes": {
            "uuid": {"string": card.uuid},
            "sharing": {"string": "timeslice"},
            "productName": {"string": card.model},
            "index": {"int": card.index},
            "numaNode": {"int": card.numa},
            "computeCapability": {"version": "8.0.0"},
            "driverVersion": {"version": "570.124.6"},
        },
        "capacity": {
            "memory": {
                "value": str(total),
                "requestPolicy": {
                    "default": "1Gi",
                    "validRange": {"min": "1Mi", "max": str(total), "step": "1Mi"},
                },
            },
            "cores": {
                "value": "100",
                "requestPolicy": {"default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}},
            },
        },
        "allowMultipleAllocations": True,
    }


def _bare_device(card: Card) -> dict[str, Any]:
    return {
        "name": f"gpu-{card.index}",
        "capacity": {"memory": {"value": str(card.memory_mib * MIB)}, "cores": {"value": "100"}},
        "allowMultipleAllocations": True,
    }


def _plain_device(card: Card) -> dict[str, Any]:
    return {"name": f"gpu-{card.index}"}


def _no_policy(device: Callable[[Card], dict[str, Any]]) -> Callable[[Card], dict[str, Any]]:
    def made(card: Card) -> dict[str, Any]:
        out = device(card)
        for capacity in out["capacity"].values():
            capacity.pop("requestPolicy", None)
        return out

    return made


def _no_attributes(card: Card) -> dict[str, Any]:
    """main's device with only the attribute its class reads (``sharing``)."""
    out = _main_device(card)
    out["attributes"] = {"sharing": out["attributes"]["sharing"]}
    return out


def _slice_of(node: str, device: Callable[[Card], dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": slice_name(node)},
        "spec": {
            "driver": DRIVER,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "nodeName": node,
            "devices": [device(c) for c in cards(node)],
        },
    }


class Shape:
    def __init__(
        self,
        name: str,
        slice_of: Callable[[str], dict[str, Any]],
        selector: Callable[[], str],
        capacity: dict[str, str] | None,
    ) -> None:
        self.name, self.slice_of, self.selector, self.capacity = name, slice_of, selector, capacity

    def slices(self, nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [self.slice_of(n["metadata"]["name"]) for n in nodes]

    def objects(self, namespace: str, template: str) -> list[dict[str, Any]]:
        """The DeviceClass and the ResourceClaimTemplate of this shape."""
        exactly: dict[str, Any] = {"deviceClassName": DRIVER, "count": 1}
        if self.capacity:
            exactly["capacity"] = {"requests": dict(self.capacity)}
        selector = self.selector()
        device_class = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": DRIVER},
            # no selector: every device of every driver on the node (a reduced case only)
            "spec": {"selectors": [{"cel": {"expression": selector}}] if selector else []},
        }
        claim_template = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": template, "namespace": namespace},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}},
        }
        return [device_class, claim_template]


SHAPES = {
    "main": Shape("main", lambda node: _slice_of(node, _main_device), lambda: MAIN_SELECTOR, SHARE_REQUEST),
    "current": Shape(
        "current",
        lambda node: build_slice(node, cards(node), 1, driver_version="570.124.6"),
        chart_selector,
        SHARE_REQUEST,
    ),
    "bare": Shape("bare", lambda node: _slice_of(node, _bare_device), lambda: DRIVER_ONLY, SHARE_REQUEST),
    "plain": Shape("plain", lambda node: _slice_of(node, _plain_device), lambda: DRIVER_ONLY, None),
    # main with one part taken away each, for what that part costs (bench/dra_allocator)
    "main-driveronly": Shape(
        "main-driveronly", lambda node: _slice_of(node, _main_device), lambda: DRIVER_ONLY, SHARE_REQUEST
    ),
    "main-nopolicy": Shape(
        "main-nopolicy",
        lambda node: _slice_of(node, _no_policy(_main_device)),
        lambda: MAIN_SELECTOR,
        SHARE_REQUEST,
    ),
    "main-noattributes": Shape(
        "main-noattributes",
        lambda node: _slice_of(node, _no_attributes),
        lambda: MAIN_SELECTOR,
        SHARE_REQUEST,
    ),
    # the reduced cases without any CEL: what one selector evaluation per device tried costs
    "bare-nocel": Shape("bare-nocel", lambda node: _slice_of(node, _bare_device), lambda: "", SHARE_REQUEST),
    "plain-nocel": Shape("plain-nocel", lambda node: _slice_of(node, _plain_device), lambda: "", None),
}


def dump(folder: Path) -> None:
    """Each shape as ``<name>.json`` ({slice, class, claim}) for the allocator's reduced case
    (bench/dra_allocator)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, shape in SHAPES.items():
        device_class, claim_template = shape.objects("bench", "t")
        claim = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "c", "namespace": "bench", "uid": "c-uid"},
            "spec": claim_template["spec"]["spec"],
        }
        doc = {"slice": shape.slice_of("bench-0"), "class": device_class, "claim": claim}
        (folder / f"{name}.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    dump(Path(sys.argv[1]))
