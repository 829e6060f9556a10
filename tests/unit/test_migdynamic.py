"""MIG on demand on the node (vgpu/deviceplugin/migdynamic.py) against the fake NVML's MIG: Allocate
makes the booked instance (or finds it after a restart), refuses a busy card or a taken
placement, and reclaim destroys what no live pod names, never an instance with processes."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.support import FakeKube, bound_pod
from vgpu.core.annotations import (
    PHASE_ANNOTATION,
    REASON_ANNOTATION,
    Allocation,
    ContainerAllocation,
    DeviceAllocation,
    MigGrant,
    encode_allocation,
)
from vgpu.core.mig import H100_80GB, Placement
from vgpu.deviceplugin.allocate import AllocateError, Allocator
from vgpu.deviceplugin.migdynamic import DynamicMig
from vgpu.node.config import NodeConfig
from vgpu.node.devices import DeviceState
from vgpu.node.fake_nvml import FakeDiscovery
from vgpu.node.paths import HostPaths

NODE = "node-a"
A = "GPU-aaaaaaaa-0000-4000-8000-000000000000"
B = "GPU-bbbbbbbb-0000-4000-8000-000000000000"


def gpus(tmp_path: Path, instances: str = "[]") -> Path:
    procs = tmp_path / "procs"
    procs.mkdir(exist_ok=True)
    f = tmp_path / "gpus.yaml"
    f.write_text(
        textwrap.dedent(f"""\
        gpus:
          - {{uuid: {A}, index: 0, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559,
              mig: {{mode: enabled, instances: {instances}}}}}
          - {{uuid: {B}, index: 1, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559, mig: {{mode: enabled}}}}
        processDir: {procs}
        """)
    )
    return f


def process_on(tmp_path: Path, key: str) -> Path:
    """A stub-driver process file for this test's own process, holding memory on ``key``."""
    stat = Path("/proc/self/stat").read_text()
    started = stat[stat.rindex(")") + 2 :].split()[19]
    f = tmp_path / "procs" / f"{os.getpid()}@{started}"
    f.write_text(f"{key} 1048576\n")
    return f


class Node:
    """One node's plugin parts over the fake file (a new Node over the same file: a restart)."""

    def __init__(self, tmp_path: Path, kube: FakeKube) -> None:
        self.discovery = FakeDiscovery(tmp_path / "gpus.yaml")
        assert self.discovery.mig is not None
        self.mig = self.discovery.mig
        self.state = DeviceState(self.discovery.cards(), NodeConfig(split=7, mig_strategy="dynamic"))
        self.dynamic = DynamicMig(NODE, self.mig, self.state.cards(), kube.list_node_pods, self.state.kick)
        self.state.mig_dynamic = self.dynamic.describe
        self.allocator = Allocator(NODE, kube, self.state, HostPaths(tmp_path / "root"), None)
        self.allocator.dynamic = self.dynamic

    def instances(self, card: str = A) -> list[tuple[str, int]]:
        return [(g.profile, g.placement.start) for g in self.mig.gpu_instances(card)]


def asks(profile: str, mem: int) -> tuple[int, int]:
    """The memory and cores a pod asks for so that ``profile`` is the smallest that holds it, as the
    extender's fit chooses (the node refuses an instance larger than the request)."""
    p = H100_80GB.profile(profile)
    cores = 100 * (p.compute_slices - 1) // 7 + 1 if p.compute_slices > 1 else 0
    slices = min(q.memory_slices for q in H100_80GB.profiles if q.memory_mib >= mem)
    return (mem if slices == p.memory_slices else p.memory_mib), cores


def add_pod(kube: FakeKube, name: str, grants: list[tuple[str, str, int]], mem: int = 5000) -> str:
    uid = f"uid-{name}"
    created = f"2026-01-01T00:00:{len(kube.pods):02d}Z"  # kubelet's order: creation
    [(_, profile, _)] = grants
    mem, cores = asks(profile, mem)
    alloc = Allocation(
        NODE,
        (
            ContainerAllocation(
                "main", tuple(DeviceAllocation(u, mem, cores, MigGrant(p, s)) for u, p, s in grants)
            ),
        ),
    )
    kube.pods.append(
        bound_pod(
            name,
            NODE,
            {"main": [(u, mem, cores) for u, _, _ in grants]},
            annotation=encode_allocation(alloc),
            uid=uid,
            created=created,
        )
    )
    return uid


def phase(kube: FakeKube, name: str) -> tuple[str | None, str | None]:
    pod = next(p for p in kube.pods if p["metadata"]["name"] == name)
    a = pod["metadata"]["annotations"]
    return a.get(PHASE_ANNOTATION), a.get(REASON_ANNOTATION)


def test_allocate_makes_the_booked_instance_and_hands_its_mig_device(tmp_path: Path) -> None:
    gpus(tmp_path)
    kube = FakeKube()
    uid = add_pod(kube, "p", [(A, "1g.10gb", 6)])
    node = Node(tmp_path, kube)
    served = node.allocator.allocate_container([f"{A}::0"])
    (dev,) = [d for d in node.mig.devices(A) if d.placement == Placement(6, 1)]
    envs = dict(served.response.envs)
    assert envs["NVIDIA_VISIBLE_DEVICES"] == dev.uuid and dev.uuid.startswith("MIG-")
    assert envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "5000m" and envs["CUDA_DEVICE_SM_LIMIT_0"] == "0"
    assert node.instances() == [("1g.10gb", 6)] and node.instances(B) == []
    # the inventory lists the instance and whose it is, for the extender
    (card,) = [d for d in node.state.inventory().devices if d.uuid == A]
    assert card.mig_dynamic is not None and card.mig_dynamic.table == "H100 80GB"
    assert [(i.profile, i.start, i.pod) for i in card.mig_dynamic.instances] == [("1g.10gb", 6, uid)]
    assert card.split == 7
    assert phase(kube, "p")[0] == "allocated"

    # a restart of the plugin (a new node over the same card state): the pod's instance is reused,
    # never made twice, and reconcile keeps it
    again = Node(tmp_path, kube)
    assert again.dynamic.reclaim().kept == 1
    made = again.dynamic.provide(uid, _container(A, "1g.10gb", 6))
    assert made[A].uuid == dev.uuid
    assert again.instances() == [("1g.10gb", 6)]


def _container(card: str, profile: str, start: int) -> ContainerAllocation:
    return ContainerAllocation("main", (DeviceAllocation(card, 5000, 0, MigGrant(profile, start)),))


def test_a_card_with_processes_outside_mig_is_never_cut(tmp_path: Path) -> None:
    gpus(tmp_path)
    kube = FakeKube()
    add_pod(kube, "p", [(A, "3g.40gb", 4)])
    node = Node(tmp_path, kube)
    process_on(tmp_path, A)
    with pytest.raises(AllocateError) as err:
        node.allocator.allocate_container([f"{A}::0"])
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "GPU busy: 1 process(es)" in str(err.value) and "3g.40gb at slice 4" in str(err.value)
    assert node.instances() == []
    got, reason = phase(kube, "p")
    assert got == "failed" and reason is not None and "GPU busy" in reason


def test_a_taken_placement_is_refused_naming_what_holds_it(tmp_path: Path) -> None:
    # a 4g a live pod holds, where the scheduler (wrongly) booked a 3g
    gpus(tmp_path, "[{profile: 4g.40gb, start: 0}]")
    kube = FakeKube()
    add_pod(kube, "holder", [(A, "4g.40gb", 0)], mem=30000)
    kube.pods[0]["metadata"]["annotations"][PHASE_ANNOTATION] = "allocated"
    add_pod(kube, "p", [(A, "3g.40gb", 0)])
    node = Node(tmp_path, kube)
    with pytest.raises(
        AllocateError, match=r"placement taken by instance\(s\) 4g.40gb at 0, which a live pod"
    ):
        node.allocator.allocate_container([f"{A}::0"])
    assert node.instances() == [("4g.40gb", 0)]


def test_a_leftover_in_the_way_is_reclaimed_at_allocate_unless_in_use(tmp_path: Path) -> None:
    gpus(tmp_path, "[{profile: 4g.40gb, start: 0}]")  # no pod names it: a leftover
    kube = FakeKube()
    add_pod(kube, "p", [(A, "3g.40gb", 0)])
    node = Node(tmp_path, kube)
    (left,) = node.mig.devices(A)
    running = process_on(tmp_path, left.uuid)
    with pytest.raises(AllocateError, match=r"placement taken by instance\(s\) 4g.40gb at 0"):
        node.allocator.allocate_container([f"{A}::0"])
    assert node.instances() == [("4g.40gb", 0)]  # never destroyed under a process
    running.unlink()
    add_pod(kube, "q", [(A, "3g.40gb", 0)])
    node.allocator.allocate_container([f"{A}::1"])
    assert node.instances() == [("3g.40gb", 0)]


def test_an_instance_another_live_pod_holds_is_never_handed_out(tmp_path: Path) -> None:
    gpus(tmp_path)
    kube = FakeKube()
    first = add_pod(kube, "first", [(A, "1g.10gb", 6)])
    node = Node(tmp_path, kube)
    node.allocator.allocate_container([f"{A}::0"])
    add_pod(kube, "second", [(A, "1g.10gb", 6)])  # a placement no extender would write twice
    with pytest.raises(AllocateError, match=f"placement taken by pod uid {first}"):
        node.allocator.allocate_container([f"{A}::1"])
    assert node.instances() == [("1g.10gb", 6)]


def test_a_grant_the_cards_table_does_not_have_is_refused(tmp_path: Path) -> None:
    gpus(tmp_path)
    kube = FakeKube()
    add_pod(kube, "p", [(A, "3g.40gb", 2)])
    node = Node(tmp_path, kube)
    with pytest.raises(AllocateError, match=r"3g.40gb starts only at \[0, 4\]"):
        node.allocator.allocate_container([f"{A}::0"])
    assert node.instances() == []


def test_reclaim_destroys_what_no_live_pod_names_but_never_an_instance_in_use(tmp_path: Path) -> None:
    gpus(tmp_path)
    kube = FakeKube()
    add_pod(kube, "p", [(A, "2g.20gb", 4)])
    add_pod(kube, "q", [(B, "1g.10gb", 6)])
    node = Node(tmp_path, kube)
    node.allocator.allocate_container([f"{A}::0"])
    node.allocator.allocate_container([f"{B}::0"])
    (dev,) = node.mig.devices(A)
    assert node.dynamic.reclaim().kept == 2  # both pods live: nothing goes
    # p leaves while its process still runs on the instance: NVML's IN_USE, tried again later
    kube.pods = [p for p in kube.pods if p["metadata"]["name"] != "p"]
    running = process_on(tmp_path, dev.uuid)
    done = node.dynamic.reclaim()
    assert len(done.busy) == 1 and done.destroyed == [] and node.instances() == [("2g.20gb", 4)]
    running.unlink()
    done = node.dynamic.reclaim()
    assert len(done.destroyed) == 1 and node.instances() == [] and node.instances(B) == [("1g.10gb", 6)]
    # a pod that finished no longer holds its instance
    next(p for p in kube.pods if p["metadata"]["name"] == "q")["status"] = {"phase": "Succeeded"}
    assert len(node.dynamic.reclaim().destroyed) == 1 and node.instances(B) == []
    (card,) = [d for d in node.state.inventory().devices if d.uuid == A]
    assert card.mig_dynamic is not None and card.mig_dynamic.instances == ()


def test_reconcile_at_start_keeps_the_pods_instances_and_reclaims_leftovers(tmp_path: Path) -> None:
    # the card holds three instances when the plugin starts: one a live pod names, one a pod
    # that finished names, one nobody names (a crash between create and the pod's failure)
    gpus(
        tmp_path, "[{profile: 3g.40gb, start: 0}, {profile: 2g.20gb, start: 4}, {profile: 1g.10gb, start: 6}]"
    )
    kube = FakeKube()
    live = add_pod(kube, "live", [(A, "3g.40gb", 0)], mem=30000)
    add_pod(kube, "done", [(A, "2g.20gb", 4)])
    next(p for p in kube.pods if p["metadata"]["name"] == "done")["status"] = {"phase": "Failed"}
    node = Node(tmp_path, kube)
    done = node.dynamic.reclaim()
    assert (done.kept, len(done.destroyed)) == (1, 2)
    assert node.instances() == [("3g.40gb", 0)]
    (card,) = [d for d in node.state.inventory().devices if d.uuid == A]
    assert card.mig_dynamic is not None
    assert [(i.profile, i.start, i.pod) for i in card.mig_dynamic.instances] == [("3g.40gb", 0, live)]


def test_a_node_not_in_dynamic_mode_refuses_a_mig_placement(tmp_path: Path) -> None:
    gpus(tmp_path)
    kube = FakeKube()
    add_pod(kube, "p", [(A, "1g.10gb", 6)])
    node = Node(tmp_path, kube)
    node.allocator.dynamic = None
    node.state.config = NodeConfig(split=7)
    with pytest.raises(AllocateError, match="placed as MIG on demand but this node's migStrategy is none"):
        node.allocator.allocate_container([f"{A}::0"])


def test_a_card_whose_instances_cannot_be_read_is_never_published_empty(tmp_path: Path) -> None:
    from vgpu.node.mig import NOT_SUPPORTED, MigRefused

    gpus(tmp_path, "[{profile: 1g.10gb, start: 6}]")
    kube = FakeKube()
    node = Node(tmp_path, kube)
    real = node.mig.gpu_instances

    def refuse(parent: str) -> list[Any]:
        raise MigRefused(NOT_SUPPORTED, f"card {parent} cannot be read")

    node.mig.gpu_instances = refuse  # type: ignore[method-assign]
    # a pass that cannot read the cards destroys nothing and keeps what it saw last
    assert node.dynamic.reclaim().destroyed == []
    (card,) = [d for d in node.state.inventory().devices if d.uuid == A]
    assert card.mig_dynamic is not None
    assert [(i.profile, i.start) for i in card.mig_dynamic.instances] == [("1g.10gb", 6)]
    # a plugin that starts unable to read a card publishes it whole-taken, never empty
    fresh = DynamicMig(NODE, node.mig, node.state.cards(), kube.list_node_pods)
    view = fresh.describe(B)
    assert view is not None and [(i.profile, i.start, i.size) for i in view.instances] == [("7g.80gb", 0, 8)]
    node.mig.gpu_instances = real  # type: ignore[method-assign]
    assert len(node.dynamic.reclaim().destroyed) == 1  # readable again: the leftover goes


def test_reclaim_destroys_nothing_while_a_live_pods_allocation_cannot_be_read(tmp_path: Path) -> None:
    gpus(tmp_path, "[{profile: 1g.10gb, start: 6}]")
    kube = FakeKube()
    add_pod(kube, "future", [(A, "1g.10gb", 6)])
    raw = kube.pods[0]["metadata"]["annotations"]
    raw["vgpu.openaios.io/allocation"] = raw["vgpu.openaios.io/allocation"].replace(
        '"version":1', '"version":9'
    )
    node = Node(tmp_path, kube)
    assert node.dynamic.reclaim().destroyed == [] and node.instances() == [("1g.10gb", 6)]
    kube.pods.clear()  # the pod is gone: its instance goes
    assert len(node.dynamic.reclaim().destroyed) == 1 and node.instances() == []


def test_two_pods_kubelet_cannot_order_with_different_placements_are_refused_never_swapped(
    tmp_path: Path,
) -> None:
    gpus(tmp_path)
    kube = FakeKube()
    add_pod(kube, "x", [(A, "1g.10gb", 5)])
    add_pod(kube, "y", [(A, "1g.10gb", 6)])
    for p in kube.pods:  # created in the same second: kubelet's order between them is undefined
        p["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
    node = Node(tmp_path, kube)
    node.allocator.tie_wait_s = 0
    with pytest.raises(AllocateError, match="cannot tell which of the pods"):
        node.allocator.allocate_container([f"{A}::0"])
    assert node.instances() == []


def test_under_driver_inject_plugin_the_container_gets_its_instances_capability_files(tmp_path: Path) -> None:
    from tests.support.driver import fake_driver
    from vgpu.node.driver import find_driver

    gpus(tmp_path)
    kube = FakeKube()
    add_pod(kube, "p", [(B, "2g.20gb", 2)])
    node = Node(tmp_path, kube)
    host = fake_driver(tmp_path / "host")
    (host / "dev/nvidia-caps").mkdir()
    from vgpu.node.mig import formula_minor

    # card B is index 1; a 2g.20gb at slice 2 is the fake's GPU instance 4, its compute instance 0
    gi, ci = formula_minor(1, 4), formula_minor(1, 4, 0)
    for minor in (gi, ci):
        (host / f"dev/nvidia-caps/nvidia-cap{minor}").write_bytes(b"")
    node.allocator.driver = find_driver(host, "/", host / "dev")
    served = node.allocator.allocate_container([f"{B}::0"])
    paths = [d.host_path for d in served.response.devices]
    assert "/dev/nvidia1" in paths
    assert f"/dev/nvidia-caps/nvidia-cap{gi}" in paths and f"/dev/nvidia-caps/nvidia-cap{ci}" in paths
    (dev,) = node.mig.devices(B)
    assert (dev.gi_minor, dev.ci_minor) == (gi, ci)

    # a capability file missing on the host: the pod is refused, naming it; the instance made for
    # it goes once kubelet marks the rejected pod Failed
    add_pod(kube, "q", [(A, "1g.10gb", 6)])
    with pytest.raises(AllocateError, match=r"/dev/nvidia-caps/nvidia-cap\d+ of a card"):
        node.allocator.allocate_container([f"{A}::0"])
    assert phase(kube, "q")[0] == "failed"
    next(p for p in kube.pods if p["metadata"]["name"] == "q")["status"] = {"phase": "Failed"}
    assert len(node.dynamic.reclaim().destroyed) == 1 and node.instances(A) == []


def test_the_node_metrics_count_instances_made_reclaimed_refused_and_left_busy(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from vgpu.deviceplugin.migmetrics import MigCollector

    gpus(tmp_path, "[{profile: 1g.10gb, start: 0}]")  # a leftover
    kube = FakeKube()
    add_pod(kube, "p", [(A, "3g.40gb", 4)])
    node = Node(tmp_path, kube)
    registry = CollectorRegistry()
    registry.register(MigCollector(node.dynamic))
    node.allocator.allocate_container([f"{A}::0"])
    node.dynamic.reclaim()
    process_on(tmp_path, B)
    add_pod(kube, "q", [(B, "1g.10gb", 6)])
    with pytest.raises(AllocateError):
        node.allocator.allocate_container([f"{B}::0"])
    text = generate_latest(registry).decode()
    assert f'vgpu_mig_instances{{node="{NODE}",profile="3g.40gb",state="held",uuid="{A}"}} 1.0' in text
    assert f'vgpu_mig_instances_made_total{{node="{NODE}",profile="3g.40gb",uuid="{A}"}} 1.0' in text
    assert f'vgpu_mig_instances_reclaimed_total{{node="{NODE}",profile="1g.10gb",uuid="{A}"}} 1.0' in text
    assert f'vgpu_mig_allocate_refusals_total{{kind="busy",node="{NODE}"}} 1.0' in text
    assert f'vgpu_mig_reclaim_busy{{node="{NODE}"}} 0.0' in text


def test_a_bad_mig_strategy_names_the_field_and_the_values() -> None:
    from vgpu.core.errors import ConfigError
    from vgpu.node.config import parse_node_config

    assert parse_node_config("migStrategy: dynamic", "n", "cfg").mig_strategy == "dynamic"
    assert parse_node_config("nodes: {n: {migStrategy: dynamic}}", "n", "cfg").mig_strategy == "dynamic"
    with pytest.raises(ConfigError, match=r"nodes\.n\.migStrategy.*none .* or dynamic .*got 'Dynamic'"):
        parse_node_config("nodes: {n: {migStrategy: Dynamic}}", "n", "cfg")
