"""The pool of several slices a node with MIG cards publishes (vgpu/dra/publish.py, ``--mig
dynamic``): written whole at one generation and slice count, left alone when the offer is the
same (a restarted plugin), all rewritten one generation higher when one slice's offer changes,
and left as one slice again when MIG is turned off."""

from __future__ import annotations

import copy
import os
import textwrap
from pathlib import Path
from typing import Any

from tests.unit.test_dra_publish import Store
from vgpu.dra.mig import MigNode
from vgpu.dra.prepare import Preparer, StatePaths
from vgpu.dra.publish import SlicePublisher
from vgpu.node.config import NodeConfig
from vgpu.node.fake_nvml import FakeDiscovery

NODE = "node-a"
BASE = f"{NODE}-vgpu.openaios.io"


class PoolStore(Store):
    """The store, also listing and deleting, and holding slices of counters (no devices)."""

    def _store(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.slices[obj["metadata"]["name"]] = obj
        self.writes += 1
        return obj

    def list_resource_slices(self, node: str, driver: str) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(s)
            for s in self.slices.values()
            if s["spec"]["nodeName"] == node and s["spec"]["driver"] == driver
        ]

    def delete_resource_slice(self, name: str) -> None:
        self.slices.pop(name, None)


def gpus(tmp_path: Path) -> Path:
    (tmp_path / "procs").mkdir(exist_ok=True)
    f = tmp_path / "gpus.yaml"
    f.write_text(
        textwrap.dedent(f"""\
        gpus:
          - {{uuid: GPU-m, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559, mig: {{mode: enabled}}}}
          - {{uuid: GPU-w, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559}}
        processDir: {tmp_path / "procs"}
        """)
    )
    return f


def publisher(tmp_path: Path, store: PoolStore, mig: bool = True) -> tuple[SlicePublisher, FakeDiscovery]:
    d = FakeDiscovery(gpus(tmp_path) if not (tmp_path / "gpus.yaml").exists() else tmp_path / "gpus.yaml")
    assert d.mig is not None
    pub = SlicePublisher(NODE, d, store)  # type: ignore[arg-type]
    if mig:
        prep = Preparer(
            NODE, StatePaths(Path("/"), tmp_path / "state"), tmp_path / "cdi", NodeConfig(), store,  # type: ignore[arg-type]
            pub.cards, mig=MigNode(d.mig),
        )  # fmt: skip
        pub.mig = prep.mig_view
    return pub, d


def pools(store: PoolStore) -> set[tuple[int, int]]:
    return {
        (s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"])
        for s in store.slices.values()
    }


def test_the_pool_is_written_whole_once_and_left_alone_by_a_restarted_plugin(tmp_path: Path) -> None:
    store = PoolStore()
    pub, _ = publisher(tmp_path, store)
    assert pub.sync() is True and pub.sync() is False
    assert set(store.slices) == {BASE, f"{BASE}-counters-0", f"{BASE}-gpu-0"}
    assert pools(store) == {(1, 3)}
    assert [d["name"] for d in store.slices[BASE]["spec"]["devices"]] == ["gpu-1"]  # the card used whole
    assert len(store.slices[f"{BASE}-gpu-0"]["spec"]["devices"]) == 25
    assert all(s["metadata"]["ownerReferences"][0]["uid"] == "node-uid" for s in store.slices.values())
    again, _ = publisher(tmp_path, store)
    assert again.sync() is False and store.writes == 3


def test_a_busy_instance_no_claim_holds_changes_the_offer_at_a_new_generation(tmp_path: Path) -> None:
    store = PoolStore()
    pub, d = publisher(tmp_path, store)
    pub.sync()
    assert d.mig is not None
    made = d.mig.create("GPU-m", "3g.40gb", 4)
    stat = Path("/proc/self/stat").read_text()
    proc = tmp_path / "procs" / f"{os.getpid()}@{stat[stat.rindex(')') + 2 :].split()[19]}"
    proc.write_text(f"{made.uuid} 1048576\n")  # a process on it: it cannot be reclaimed
    assert pub.sync() is True
    assert pools(store) == {(2, 3)}
    offered = store.slices[f"{BASE}-gpu-0"]["spec"]["devices"]
    assert all(dev["attributes"]["placementStart"]["int"] < 4 for dev in offered)
    proc.unlink()
    assert pub.sync() is True and pools(store) == {(3, 3)}  # reclaimed, offered again
    assert d.mig.devices("GPU-m") == []
    assert len(store.slices[f"{BASE}-gpu-0"]["spec"]["devices"]) == 25


def test_turning_mig_off_leaves_one_slice_counted_alone(tmp_path: Path) -> None:
    store = PoolStore()
    publisher(tmp_path, store)[0].sync()
    off, _ = publisher(tmp_path, store, mig=False)
    assert off.sync() is True
    main = store.slices[BASE]
    assert main["spec"]["pool"] == {"name": NODE, "generation": 2, "resourceSliceCount": 1}
    assert [d["name"] for d in main["spec"]["devices"]] == ["gpu-0", "gpu-1"]
    assert list(store.slices) == [BASE]  # the MIG slices gone with it


def test_the_health_stream_names_each_placement_of_a_mig_card(tmp_path: Path) -> None:
    from vgpu.dra.server import HealthService

    store = PoolStore()
    pub, _ = publisher(tmp_path, store)
    pub.sync()
    _, cards = pub.health()
    answer = HealthService(NODE, pub).answer(cards)
    names = [d.device.device_name for d in answer.devices]
    assert len(names) == 26 and "gpu-1" in names and "gpu-0" not in names
    assert "gpu-0-mig-3g-40gb-4" in names  # what a claim on that placement holds


def test_without_mig_a_card_in_mig_mode_is_not_offered_as_shares(tmp_path: Path, caplog: Any) -> None:
    from vgpu.dra.mig import in_mig_mode

    store = PoolStore()
    off, d = publisher(tmp_path, store, mig=False)
    with caplog.at_level("ERROR", logger="vgpu.dra.mig"):
        off.unoffered = frozenset(in_mig_mode(d, [c.uuid for c in off.cards()]))
    assert off.unoffered == {"GPU-m"}
    assert "--mig dynamic" in caplog.text and "GPU-m" in caplog.text
    assert off.sync() is True
    assert [dev["name"] for dev in store.slices[BASE]["spec"]["devices"]] == ["gpu-1"]
