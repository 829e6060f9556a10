"""NVML discovery on a real GPU agrees with nvidia-smi and sysfs (run with `pytest -m gpu`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from vgpu.node.nvml import NvmlDiscovery

pytestmark = pytest.mark.gpu


def smi() -> list[dict[str, str]]:
    out = subprocess.run(
        [
            "nvidia-smi",
            "--query-gpu=index,uuid,name,memory.total,pci.bus_id",
            "--format=csv,noheader,nounits",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = []
    for line in out.strip().splitlines():
        index, uuid, name, mem, bus = (x.strip() for x in line.split(","))
        rows.append({"index": index, "uuid": uuid, "name": name, "memory": mem, "bus": bus})
    return rows


def test_cards_match_nvidia_smi() -> None:
    expected = smi()
    nvml = NvmlDiscovery()
    try:
        cards = nvml.cards()
        assert [(str(c.index), c.uuid, c.model) for c in cards] == [
            (r["index"], r["uuid"], r["name"]) for r in expected
        ]
        for card, row in zip(cards, expected, strict=True):
            assert card.memory_mib == int(row["memory"])  # nvidia-smi reports MiB too
            assert card.healthy
            assert set(card.links) == {c.uuid for c in cards if c.uuid != card.uuid}
            assert set(card.links.values()) <= {"nvlink", "pcie"}
    finally:
        nvml.close()


def test_numa_node_matches_sysfs() -> None:
    nvml = NvmlDiscovery()
    try:
        for card, row in zip(nvml.cards(), smi(), strict=True):
            bus = row["bus"].lower()
            bus = bus[4:] if len(bus.split(":")[0]) == 8 else bus
            sysfs = Path("/sys/bus/pci/devices") / bus / "numa_node"
            if sysfs.exists():
                assert card.numa == max(int(sysfs.read_text().strip()), -1)
    finally:
        nvml.close()


def test_usage_reads_memory_and_no_health_event_arrives_on_a_quiet_card() -> None:
    nvml = NvmlDiscovery()
    try:
        cards = nvml.cards()
        usage = nvml.usage(cards[0].uuid)
        assert usage is not None and usage.memory_total_mib == cards[0].memory_mib
        assert 0 <= usage.utilization_percent <= 100
        assert nvml.usage("GPU-not-a-card") is None
        assert nvml.wait_health_events(0.2) == []
    finally:
        nvml.close()
