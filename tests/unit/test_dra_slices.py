"""The node's ResourceSlice built from its cards (vgpu/dra/slices.py): the DRA names of common
contract, the capacity policies, unhealthy cards left out, quantities compared as values."""

from __future__ import annotations

from dataclasses import replace

from vgpu.dra.slices import DRIVER, build_slice, fingerprint, semver, slice_name
from vgpu.node.discovery import Card

CARDS = [
    Card(uuid="GPU-a", index=0, model="NVIDIA H200", memory_mib=143771, numa=0, compute_capability="9.0"),
    Card(uuid="GPU-b", index=1, model="NVIDIA H200", memory_mib=143771),
]


def test_one_device_per_healthy_card_with_the_shared_names() -> None:
    s = build_slice("node-a", CARDS, 3, "570.124.06", node_uid="u-1")
    assert s["apiVersion"] == "resource.k8s.io/v1" and s["kind"] == "ResourceSlice"
    assert s["metadata"]["name"] == "node-a-vgpu.openaios.io"
    assert s["metadata"]["ownerReferences"][0] == {
        "apiVersion": "v1",
        "kind": "Node",
        "name": "node-a",
        "uid": "u-1",
        "controller": True,
    }
    spec = s["spec"]
    assert spec["driver"] == DRIVER == "vgpu.openaios.io"
    assert spec["pool"] == {"name": "node-a", "generation": 3, "resourceSliceCount": 1}
    assert spec["nodeName"] == "node-a"
    gpu0, gpu1 = spec["devices"]
    assert gpu0["name"] == "gpu-0" and gpu1["name"] == "gpu-1"
    assert gpu0["attributes"] == {
        "uuid": {"string": "GPU-a"},
        "sharing": {"string": "timeslice"},
        "productName": {"string": "NVIDIA H200"},
        "index": {"int": 0},
        "numaNode": {"int": 0},
        "computeCapability": {"version": "9.0.0"},
        "driverVersion": {"version": "570.124.6"},
    }
    assert gpu1["attributes"]["numaNode"] == {"int": -1}
    assert "computeCapability" not in gpu1["attributes"]  # unknown: not made up
    assert gpu0["allowMultipleAllocations"] is True
    memory = gpu0["capacity"]["memory"]
    assert memory["value"] == str(143771 << 20)
    assert memory["requestPolicy"] == {
        "default": "1Gi",
        "validRange": {"min": "1Mi", "max": str(143771 << 20), "step": "1Mi"},
    }
    assert gpu0["capacity"]["cores"] == {
        "value": "100",
        "requestPolicy": {"default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}},
    }


def test_an_unhealthy_card_leaves_the_slice() -> None:
    s = build_slice("node-a", [CARDS[0], replace(CARDS[1], healthy=False)], 1)
    assert [d["name"] for d in s["spec"]["devices"]] == ["gpu-0"]
    assert fingerprint(s) != fingerprint(build_slice("node-a", CARDS, 1))


def test_every_device_carries_the_nodes_sharing_mode_and_a_change_of_mode_is_a_change_of_offer() -> None:
    mps = build_slice("node-a", CARDS, 1, sharing="mps")
    assert [d["attributes"]["sharing"] for d in mps["spec"]["devices"]] == [{"string": "mps"}] * 2
    timeslice = build_slice("node-a", CARDS, 1)
    assert fingerprint(mps) != fingerprint(timeslice)
    # a slice of an older plugin, without the attribute, is rewritten with it
    older = build_slice("node-a", CARDS, 1)
    for d in older["spec"]["devices"]:
        del d["attributes"]["sharing"]
    assert fingerprint(older) is not None and fingerprint(older) != fingerprint(timeslice)


def test_memory_scaling_as_the_device_plugins_inventory() -> None:
    s = build_slice("n", [replace(CARDS[0], memory_mib=1000)], 1, memory_scaling=1.5)
    assert s["spec"]["devices"][0]["capacity"]["memory"]["value"] == str(1500 << 20)


def test_the_fingerprint_reads_quantities_as_the_api_server_rewrites_them() -> None:
    s = build_slice("n", [replace(CARDS[0], memory_mib=1024)], 1)
    served = build_slice("n", [replace(CARDS[0], memory_mib=1024)], 7)
    served["spec"]["devices"][0]["capacity"]["memory"]["value"] = "1Gi"
    assert fingerprint(s) == fingerprint(served)  # generation aside, same offer
    assert fingerprint({"spec": {"devices": [{"name": "x"}]}}) is None
    assert fingerprint(None) is None


def test_versions_become_semantic_versions() -> None:
    assert semver("570.124.06") == "570.124.6"
    assert semver("550.54") == "550.54.0"
    assert semver("9.0") == "9.0.0"
    assert semver("1.2.3.4") == "1.2.3"
    assert semver("") is None and semver("beta") is None


def test_a_long_node_name_still_gives_a_valid_slice_name() -> None:
    assert len(slice_name("n" * 253)) == 253


def test_a_card_under_1gib_defaults_to_all_of_it_within_the_range() -> None:
    s = build_slice("n", [replace(CARDS[0], memory_mib=512)], 1)
    policy = s["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"]
    assert policy["default"] == str(512 << 20) == policy["validRange"]["max"]
