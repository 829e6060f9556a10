"""The node's ResourceSlice kept in step with its cards (vgpu/dra/publish.py), over the fake NVML
file the sandbox uses and a slice store that answers as the API server does (resourceVersion,
409 on a stale one, quantities rewritten): one write per change, the pool's generation up by one
for each, nothing written when the offer is the same (a restarted plugin)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from vgpu.core.errors import ConflictError
from vgpu.dra.publish import SlicePublisher
from vgpu.node.fake_nvml import FakeDiscovery

GPUS = """driverVersion: "570.86"
gpus:
  - {uuid: GPU-0, memoryMiB: 1024, computeCapability: "8.0"}
  - {uuid: GPU-1, memoryMiB: 1024, healthy: %s}
"""


class Store:
    """ResourceSlices as the API server keeps them."""

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.writes = 0

    def node_uid(self, node: str) -> str | None:
        return "node-uid"

    def get_resource_slice(self, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.slices.get(name))

    def _store(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        for d in obj["spec"]["devices"]:  # the API server's canonical quantities
            value = int(d["capacity"]["memory"]["value"])
            if value % (1 << 30) == 0:
                d["capacity"]["memory"]["value"] = f"{value >> 30}Gi"
        self.slices[obj["metadata"]["name"]] = obj
        self.writes += 1
        return obj

    def create_resource_slice(self, obj: dict[str, Any]) -> dict[str, Any]:
        if obj["metadata"]["name"] in self.slices:
            raise ConflictError("exists", status=409)
        return self._store(obj)

    def replace_resource_slice(self, obj: dict[str, Any]) -> dict[str, Any]:
        now = self.slices[obj["metadata"]["name"]]
        if obj["metadata"].get("resourceVersion") != now["metadata"]["resourceVersion"]:
            raise ConflictError("changed", status=409)
        return self._store(obj)


@pytest.fixture
def gpus(tmp_path: Path) -> Path:
    path = tmp_path / "gpus.yaml"
    path.write_text(GPUS % "true")
    return path


def test_created_once_then_left_alone_also_by_a_new_plugin(gpus: Path) -> None:
    store = Store()
    pub = SlicePublisher("node-a", FakeDiscovery(gpus), store)  # type: ignore[arg-type]
    assert pub.sync() is True and pub.sync() is False
    s = store.slices["node-a-vgpu.openaios.io"]
    assert s["spec"]["pool"]["generation"] == 1 and s["metadata"]["ownerReferences"][0]["uid"] == "node-uid"
    assert s["spec"]["devices"][0]["capacity"]["memory"]["value"] == "1Gi"  # rewritten, still the same
    assert s["spec"]["devices"][0]["attributes"]["driverVersion"] == {"version": "570.86.0"}
    again = SlicePublisher("node-a", FakeDiscovery(gpus), store)  # type: ignore[arg-type]
    assert again.sync() is False and store.writes == 1 and again.generation == 1


def test_an_unhealthy_card_leaves_with_a_new_generation_and_comes_back(gpus: Path) -> None:
    store = Store()
    discovery = FakeDiscovery(gpus, poll_s=0.01)
    pub = SlicePublisher("node-a", discovery, store)  # type: ignore[arg-type]
    pub.sync()
    gpus.write_text(GPUS % "false")
    pub.start()
    try:
        from tests.support import wait_for

        wait_for(lambda: store.writes == 2, "the slice without GPU-1", timeout=10)
        s = store.slices["node-a-vgpu.openaios.io"]
        assert [d["name"] for d in s["spec"]["devices"]] == ["gpu-0"]
        assert s["spec"]["pool"]["generation"] == 2
        assert [c.healthy for c in pub.cards()] == [True, False]
        gpus.write_text(GPUS % "true")
        wait_for(lambda: store.writes == 3, "GPU-1 back", timeout=10)
        assert store.slices["node-a-vgpu.openaios.io"]["spec"]["pool"]["generation"] == 3
    finally:
        pub.stop()


def test_a_slice_changed_by_someone_else_is_read_again(gpus: Path) -> None:
    store = Store()
    pub = SlicePublisher("node-a", FakeDiscovery(gpus), store)  # type: ignore[arg-type]
    pub.sync()
    store.slices["node-a-vgpu.openaios.io"]["spec"]["devices"] = []  # e.g. an old plugin's slice
    assert pub.sync() is True
    assert len(store.slices["node-a-vgpu.openaios.io"]["spec"]["devices"]) == 2
    del store.slices["node-a-vgpu.openaios.io"]  # the kubelet wiped it at its start
    assert pub.sync() is True and "node-a-vgpu.openaios.io" in store.slices
