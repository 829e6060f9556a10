"""Cards become kubelet device IDs and the inventory of contract 2 (docs/contracts.md); preferred
allocations spread cards."""

from __future__ import annotations

import logging
import threading

import pytest

from vgpu.core.annotations import decode_devices, encode_devices
from vgpu.deviceplugin.server import kubelet_devices
from vgpu.node.config import NodeConfig
from vgpu.node.devices import DeviceState, card_of, prefer
from vgpu.node.discovery import Card

CARDS = [
    Card("GPU-a", 0, "H200", 1000, numa=0, links={"GPU-b": "nvlink"}),
    Card("GPU-b", 1, "H200", 1000, numa=-1, links={"GPU-a": "nvlink"}),
]


def test_each_card_is_advertised_as_split_device_ids_with_its_numa_node() -> None:
    state = DeviceState(CARDS, NodeConfig(split=3))
    devices = kubelet_devices(state)  # as ListAndWatch sends them
    assert [d.ID for d in devices] == [f"GPU-{c}::{n}" for c in "ab" for n in range(3)]
    assert {card_of(d.ID) for d in devices} == {"GPU-a", "GPU-b"}
    assert [n.ID for n in devices[0].topology.nodes] == [0]
    assert not devices[3].HasField("topology")
    assert all(d.health == "Healthy" for d in devices)


def test_the_inventory_applies_memory_and_core_scaling_and_round_trips() -> None:
    cfg = NodeConfig(split=5, device_memory_scaling=1.5, device_core_scaling=2, oversubscribe=True)
    inv = DeviceState(CARDS, cfg).inventory()
    assert [(d.memory_mib, d.cores, d.split) for d in inv.devices] == [(1500, 200, 5), (1500, 200, 5)]
    assert decode_devices(encode_devices(inv)) == inv


def test_a_health_change_wakes_waiters_and_marks_the_cards_devices() -> None:
    state = DeviceState(CARDS, NodeConfig(split=2))
    seen = state.version
    woke: list[int] = []
    t = threading.Thread(target=lambda: woke.append(state.wait_change(seen, 5.0)))
    t.start()
    assert state.set_health("GPU-b", False) is True
    t.join(5)
    assert woke and woke[0] != seen
    assert [d.health for d in state.kubelet_devices()] == ["Healthy", "Healthy", "Unhealthy", "Unhealthy"]
    assert state.set_health("GPU-b", False) is False  # no change, no new version
    assert [d.healthy for d in state.inventory().devices] == [True, False]


def test_preferred_allocation_puts_each_vgpu_on_its_own_card() -> None:
    available = ["GPU-a::0", "GPU-a::1", "GPU-b::0", "GPU-c::0", "GPU-c::1", "GPU-c::2"]
    picked = prefer(available, [], 2)
    assert len({card_of(i) for i in picked}) == 2
    assert card_of(picked[0]) == "GPU-c"  # the card with the most free IDs first


def test_preferred_allocation_keeps_the_must_include_ids() -> None:
    picked = prefer(["GPU-a::0", "GPU-b::0", "GPU-b::1"], ["GPU-a::0"], 2)
    assert picked == ["GPU-a::0", "GPU-b::0"]


def test_preferred_allocation_fills_from_one_card_when_cards_run_out() -> None:
    assert sorted(prefer(["GPU-a::0", "GPU-a::1"], [], 2)) == ["GPU-a::0", "GPU-a::1"]


def test_preferred_allocation_follows_the_cards_the_scheduler_chose() -> None:
    available = ["GPU-a::0", "GPU-b::0", "GPU-c::0", "GPU-c::1", "GPU-c::2"]
    assert prefer(available, [], 2, wanted=["GPU-b", "GPU-a"]) == ["GPU-b::0", "GPU-a::0"]
    # a wanted card with no free ID left: the rest is filled the usual way
    assert prefer(available, [], 2, wanted=["GPU-z", "GPU-a"]) == ["GPU-a::0", "GPU-c::0"]


def test_on_a_dra_node_the_plugin_offers_no_vgpu_says_why_and_offers_them_again_when_relabelled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tests.support import FakeKube
    from vgpu.core.annotations import DEVICES_ANNOTATION
    from vgpu.deviceplugin.report import NodeReporter

    api = FakeKube()
    api.labels["n1"] = {"openaios.io/gpu-mode": "dra"}
    state = DeviceState(CARDS, NodeConfig(split=2))
    reporter = NodeReporter("n1", "ns", state, api)
    seen = state.version
    with caplog.at_level(logging.WARNING, logger="vgpu.deviceplugin.report"):
        reporter.run_once()
    assert state.kubelet_devices() == [] and state.version != seen  # ListAndWatch sends the empty list
    assert decode_devices(api.nodes["n1"][DEVICES_ANNOTATION]).devices == ()
    assert "had label openaios.io/gpu-mode=dra (DRA mode)" in caplog.text
    assert "advertises no vGPUs" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vgpu.deviceplugin.report"):
        reporter.run_once()  # said once per change, not at every renewal
    assert caplog.text == ""
    api.labels["n1"] = {"openaios.io/gpu-mode": "device-plugin"}
    reporter.run_once()
    assert len(state.kubelet_devices()) == 4
    assert len(decode_devices(api.nodes["n1"][DEVICES_ANNOTATION]).devices) == 2
