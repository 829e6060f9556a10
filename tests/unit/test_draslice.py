"""The slice's device shape has one home (vgpu/core/draslice.py): what the node plugin writes is
what ``vgpu status`` reads back, through the same names, also after the API server rewrites the
quantities."""

from __future__ import annotations

import copy

from vgpu.commands.status_dra import dra_cards
from vgpu.core import draslice as shape
from vgpu.dra.slices import build_slice
from vgpu.node.discovery import Card


def _slice(sharing: str = "timeslice") -> dict:
    cards = [
        Card("GPU-a", 0, "NVIDIA H200", 143771, numa=0, compute_capability="9.0"),
        Card("GPU-b", 1, "NVIDIA H200", 143771, numa=1, compute_capability="9.0"),
    ]
    return build_slice("n1", cards, 3, driver_version="570.124.06", sharing=sharing)


def test_status_reads_what_the_plugin_writes() -> None:
    got = dra_cards([_slice("mps")])
    assert got == {
        "n1": {
            shape.device_name(i): {
                "index": i,
                "uuid": uuid,
                "model": "NVIDIA H200",
                "memory_mib": 143771,
                "cores": shape.CORES,
                "mode": "mps",
            }
            for i, uuid in ((0, "GPU-a"), (1, "GPU-b"))
        }
    }


def test_readers_take_the_api_servers_quantities_and_refuse_malformed_ones() -> None:
    device = copy.deepcopy(_slice()["spec"]["devices"][0])
    device["capacity"][shape.MEMORY]["value"] = "1Gi"  # as the API server may write 1073741824
    assert shape.capacity(device, shape.MEMORY) == 1 << 30
    device["capacity"][shape.CORES_CAPACITY]["value"] = "lots"
    assert shape.capacity(device, shape.CORES_CAPACITY) is None
    assert shape.capacity(device, "absent") is None
    assert shape.capacity({"capacity": {shape.MEMORY: "80Gi"}}, shape.MEMORY) is None  # not an object
    assert shape.attribute(device, shape.UUID, "string") == "GPU-a"
    assert shape.attribute(device, shape.UUID, "int") is None  # another type
    assert shape.attribute({"attributes": {shape.UUID: "GPU-a"}}, shape.UUID, "string") is None
    assert shape.attribute({}, shape.UUID, "string") is None
