"""The annotation codecs of contracts 2 and 3 (docs/contracts.md): round trips, the wire shape,
and errors naming the field."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vgpu.core.annotations import (
    ALLOCATION_ANNOTATION,
    DEVICES_ANNOTATION,
    Allocation,
    ContainerAllocation,
    Device,
    DeviceAllocation,
    NodeInventory,
    decode_allocation,
    decode_devices,
    encode_allocation,
    encode_devices,
    lease_name,
)
from vgpu.core.errors import AnnotationError, VgpuError

H200 = Device(
    uuid="GPU-aaaa",
    index=0,
    model="NVIDIA H200",
    memory_mib=143771,
    cores=100,
    split=10,
    numa=1,
    healthy=True,
    links={"GPU-bbbb": "nvlink"},
)


def _device_doc(**overrides: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "uuid": "GPU-aaaa",
        "index": 0,
        "model": "NVIDIA H200",
        "memoryMiB": 143771,
        "cores": 100,
        "split": 10,
        "numa": 1,
        "healthy": True,
        "links": {"GPU-bbbb": "nvlink"},
    }
    doc.update(overrides)
    return doc


def test_inventory_encodes_to_the_contract_field_names() -> None:
    doc = json.loads(encode_devices(NodeInventory(devices=(H200,))))
    assert doc == {"version": 1, "devices": [_device_doc()]}


def test_inventory_decodes_what_the_contract_describes() -> None:
    inv = decode_devices(json.dumps({"version": 1, "devices": [_device_doc()]}))
    assert inv.devices == (H200,)


def test_inventory_encoding_is_deterministic_so_writers_can_compare_strings() -> None:
    links_a = {"GPU-b": "nvlink", "GPU-c": "pcie"}
    links_b = {"GPU-c": "pcie", "GPU-b": "nvlink"}
    a = NodeInventory(devices=(Device("GPU-a", 0, "m", 1, 100, 1, links=links_a),))
    b = NodeInventory(devices=(Device("GPU-a", 0, "m", 1, 100, 1, links=links_b),))
    assert encode_devices(a) == encode_devices(b)


def test_inventory_accepts_null_numa_as_unknown() -> None:
    inv = decode_devices(json.dumps({"version": 1, "devices": [_device_doc(numa=None)]}))
    assert inv.devices[0].numa == -1


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"devices": []}, "version"),
        ({"version": 3, "devices": []}, "version"),
        ({"version": "1", "devices": []}, "version"),
        ({"version": True, "devices": []}, "version"),
        ({"version": 1}, "devices"),
        ({"version": 1, "devices": {}}, "devices"),
        ({"version": 1, "devices": [7]}, "devices[0]"),
        ({"version": 1, "devices": [_device_doc(memoryMiB="lots")]}, "devices[0].memoryMiB"),
        ({"version": 1, "devices": [_device_doc(memoryMiB=-1)]}, "devices[0].memoryMiB"),
        ({"version": 1, "devices": [_device_doc(cores=1.5)]}, "devices[0].cores"),
        ({"version": 1, "devices": [_device_doc(split=0)]}, "devices[0].split"),
        ({"version": 1, "devices": [_device_doc(uuid="")]}, "devices[0].uuid"),
        ({"version": 1, "devices": [_device_doc(healthy="yes")]}, "devices[0].healthy"),
        ({"version": 1, "devices": [_device_doc(links=["x"])]}, "devices[0].links"),
        ({"version": 1, "devices": [_device_doc(), _device_doc(index=1)]}, "devices[1].uuid"),
        (
            {"version": 1, "devices": [{k: v for k, v in _device_doc().items() if k != "index"}]},
            "devices[0].index",
        ),
    ],
)
def test_a_bad_inventory_raises_an_error_naming_the_field(doc: dict[str, object], field: str) -> None:
    with pytest.raises(AnnotationError) as info:
        decode_devices(json.dumps(doc))
    assert info.value.field == field
    assert info.value.source == DEVICES_ANNOTATION
    assert field in str(info.value)


@pytest.mark.parametrize("text", [None, "", "  ", "{not json", "[1, 2]", "null"])
def test_an_inventory_that_is_not_a_json_object_is_an_annotation_error(text: str | None) -> None:
    with pytest.raises(AnnotationError) as info:
        decode_devices(text)
    assert isinstance(info.value, VgpuError)
    assert DEVICES_ANNOTATION in str(info.value)


def test_a_json_syntax_error_is_kept_as_the_cause() -> None:
    with pytest.raises(AnnotationError) as info:
        decode_devices("{oops")
    assert isinstance(info.value.__cause__, ValueError)


ALLOC = Allocation(
    node="node-a",
    containers=(
        ContainerAllocation("init", (DeviceAllocation("GPU-a", 1000, 0),)),
        ContainerAllocation(
            "main", (DeviceAllocation("GPU-a", 3000, 30), DeviceAllocation("GPU-b", 3000, 30))
        ),
    ),
)


def test_allocation_encodes_to_the_contract_field_names() -> None:
    doc = json.loads(encode_allocation(ALLOC))
    assert doc == {
        "version": 1,
        "node": "node-a",
        "containers": [
            {"name": "init", "devices": [{"uuid": "GPU-a", "memoryMiB": 1000, "cores": 0}]},
            {
                "name": "main",
                "devices": [
                    {"uuid": "GPU-a", "memoryMiB": 3000, "cores": 30},
                    {"uuid": "GPU-b", "memoryMiB": 3000, "cores": 30},
                ],
            },
        ],
    }


def test_allocation_round_trips_and_finds_containers_by_name() -> None:
    back = decode_allocation(encode_allocation(ALLOC))
    assert back == ALLOC
    main = back.container("main")
    assert main is not None and [d.uuid for d in main.devices] == ["GPU-a", "GPU-b"]
    assert back.container("sidecar") is None


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"version": 9, "node": "n", "containers": []}, "version"),
        ({"version": 1, "containers": []}, "node"),
        ({"version": 1, "node": "n"}, "containers"),
        ({"version": 1, "node": "n", "containers": [{"devices": []}]}, "containers[0].name"),
        ({"version": 1, "node": "n", "containers": [{"name": "c"}]}, "containers[0].devices"),
        (
            {
                "version": 1,
                "node": "n",
                "containers": [{"name": "c", "devices": [{"uuid": "u", "cores": 1}]}],
            },
            "containers[0].devices[0].memoryMiB",
        ),
        (
            {
                "version": 1,
                "node": "n",
                "containers": [{"name": "c", "devices": [{"uuid": "u", "memoryMiB": 1, "cores": -3}]}],
            },
            "containers[0].devices[0].cores",
        ),
    ],
)
def test_a_bad_allocation_raises_an_error_naming_the_field(doc: dict[str, object], field: str) -> None:
    with pytest.raises(AnnotationError) as info:
        decode_allocation(json.dumps(doc))
    assert info.value.field == field
    assert info.value.source == ALLOCATION_ANNOTATION


def test_the_plugin_lease_is_named_after_the_node() -> None:
    assert lease_name("gpu-7") == "vgpu-gpu-7"


_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)


@given(
    st.lists(
        st.builds(
            Device,
            uuid=_names.map(lambda s: "GPU-" + s),
            index=st.integers(0, 15),
            model=st.text(max_size=20),
            memory_mib=st.integers(0, 10**6),
            cores=st.integers(0, 400),
            split=st.integers(1, 64),
            numa=st.integers(-1, 7),
            healthy=st.booleans(),
            links=st.dictionaries(_names, st.sampled_from(["nvlink", "pcie", "sys"]), max_size=3),
        ),
        max_size=8,
        unique_by=lambda d: d.uuid,
    )
)
def test_any_inventory_round_trips(devices: list[Device]) -> None:
    inv = NodeInventory(devices=tuple(devices))
    assert decode_devices(encode_devices(inv)) == inv


@given(
    _names,
    st.lists(
        st.builds(
            ContainerAllocation,
            name=_names,
            devices=st.lists(
                st.builds(
                    DeviceAllocation, uuid=_names, memory_mib=st.integers(0, 10**6), cores=st.integers(0, 100)
                ),
                max_size=4,
            ).map(tuple),
        ),
        max_size=5,
    ),
)
def test_any_allocation_round_trips(node: str, containers: list[ContainerAllocation]) -> None:
    alloc = Allocation(node=node, containers=tuple(containers))
    assert decode_allocation(encode_allocation(alloc)) == alloc
