"""Allocate picks the pod and container kubelet is starting and answers with contract 4
(docs/contracts.md).

The pods come from an in-memory list shaped like the API server's JSON; the integration tests
run the same code against the sandbox's real API server.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import grpc
import pytest

from tests.support import FakeKube, bound_pod
from vgpu.core.annotations import (
    ALLOCATION_ANNOTATION,
    PHASE_ANNOTATION,
    REASON_ANNOTATION,
)
from vgpu.deviceplugin.allocate import AllocateError, Allocator
from vgpu.deviceplugin.arrivals import Arrivals
from vgpu.hookabi.grant import Grant, read_grant
from vgpu.node.config import NodeConfig
from vgpu.node.devices import DeviceState
from vgpu.node.discovery import Card
from vgpu.node.hooklib import install_hook
from vgpu.node.paths import HostPaths

NODE = "node-a"
CARDS = [Card(f"GPU-{c}", i, "H200", 80000) for i, c in enumerate("abcd")]


class Pods(FakeKube):
    def add(
        self,
        name: str,
        containers: dict[str, list[tuple[str, int, int]]],
        init: tuple[str, ...] = (),
        created: str = "2026-01-01T00:00:00Z",
        annotation: str | None = None,
        priority: dict[str, str] | None = None,
    ) -> str:
        uid = f"uid-{name}"
        self.pods.append(
            bound_pod(
                name,
                NODE,
                containers,
                init=init,
                annotation=annotation,
                priority=priority,
                uid=uid,
                created=created,
            )
        )
        return uid

    def phase(self, name: str) -> str | None:
        pod = next(p for p in self.pods if p["metadata"]["name"] == name)
        return pod["metadata"]["annotations"].get(PHASE_ANNOTATION)


@pytest.fixture
def pods() -> Pods:
    return Pods()


def make(
    pods: Pods,
    tmp_path: Path,
    config: NodeConfig | None = None,
    hook: bool = True,
    arrivals: Arrivals | None = None,
) -> Allocator:
    paths = HostPaths(tmp_path)
    lib = tmp_path / "build/libvgpu.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\x7fELF fake hook")
    return Allocator(
        NODE,
        pods,
        DeviceState(CARDS, config or NodeConfig(split=4)),
        paths,
        install_hook(lib, paths) if hook else None,
        arrivals,
    )


def test_a_single_container_gets_its_cards_limits_region_and_hook(pods: Pods, tmp_path: Path) -> None:
    uid = pods.add("p", {"main": [("GPU-b", 3000, 30)]})
    served = make(pods, tmp_path).allocate_container(["GPU-c::0"])
    envs = dict(served.response.envs)
    assert envs == {
        "NVIDIA_VISIBLE_DEVICES": "GPU-b",
        "CUDA_DEVICE_MEMORY_LIMIT_0": "3000m",
        "CUDA_DEVICE_SM_LIMIT_0": "30",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": f"/var/lib/vgpu/containers/{uid}_main/vgpu.region",
        "CUDA_TASK_PRIORITY": "1",
        "CUDA_SM_POLICY": "cap",
    }
    mounts = {m.container_path: (m.host_path, m.read_only) for m in served.response.mounts}
    region_dir = tmp_path / f"var/lib/vgpu/containers/{uid}_main"
    assert mounts[f"/var/lib/vgpu/containers/{uid}_main"] == (str(region_dir), False)
    assert region_dir.is_dir()
    # the limits are granted on the host and mounted read-only: the container cannot raise them
    record = tmp_path / f"var/lib/vgpu/grants/{uid}_main.limits"
    assert read_grant(record) == Grant(
        uuids=("GPU-b",),
        limits=(3000 << 20,),
        sm_limits=(30,),
        priority=1,
        region_path=f"/var/lib/vgpu/containers/{uid}_main/vgpu.region",
    )
    assert record.parent.stat().st_mode & 0o777 == 0o700 and record.stat().st_mode & 0o777 == 0o644
    assert mounts["/etc/vgpu/limits"] == (str(record), True)
    assert [host for host, _ in mounts.values() if host.startswith(str(record.parent))] == [str(record)]
    lib_host, _ = mounts["/usr/local/vgpu/libvgpu.so"]
    preload_host, ro = mounts["/etc/ld.so.preload"]
    assert ro and Path(preload_host).read_text() == "/usr/local/vgpu/libvgpu.so\n"
    assert Path(lib_host).read_bytes() == b"\x7fELF fake hook"
    # which version it got is recorded beside the grant, out of the container's reach
    version = Path(lib_host).parent.name
    assert (record.parent / f"{uid}_main.hook").read_text() == version + "\n"
    assert pods.phase("p") == "allocated"


def test_several_vgpus_are_indexed_in_the_order_of_visible_devices(pods: Pods, tmp_path: Path) -> None:
    pods.add("p", {"main": [("GPU-d", 1000, 10), ("GPU-a", 1000, 10)]}, priority={"main": "0"})
    cfg = NodeConfig(split=4, device_memory_scaling=2, oversubscribe=True)
    envs = dict(make(pods, tmp_path, cfg).allocate_container(["GPU-a::0", "GPU-d::0"]).response.envs)
    assert envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-d,GPU-a"
    assert (envs["CUDA_DEVICE_MEMORY_LIMIT_0"], envs["CUDA_DEVICE_SM_LIMIT_0"]) == ("1000m", "10")
    assert (envs["CUDA_DEVICE_MEMORY_LIMIT_1"], envs["CUDA_DEVICE_SM_LIMIT_1"]) == ("1000m", "10")
    assert envs["CUDA_OVERSUBSCRIBE"] == "true"
    assert envs["CUDA_TASK_PRIORITY"] == "0"
    # memory scaled 2x: half of each grant is the card's, the rest spills to host memory
    assert (envs["CUDA_DEVICE_MEMORY_BUDGET_0"], envs["CUDA_DEVICE_MEMORY_BUDGET_1"]) == ("500m", "500m")
    (grant,) = (tmp_path / "var/lib/vgpu/grants").glob("*.limits")
    assert read_grant(grant) == Grant(
        uuids=("GPU-d", "GPU-a"),
        limits=(1000 << 20, 1000 << 20),
        sm_limits=(10, 10),
        budgets=(500 << 20, 500 << 20),
        priority=0,
        oversubscribe=True,
        region_path=f"/var/lib/vgpu/containers/{grant.name.removesuffix('.limits')}/vgpu.region",
    )


@pytest.mark.parametrize(
    ("scaling", "mib", "budget"),
    [(1.5, 3000, "2000m"), (1.2, 3000, "2500m"), (3, 1000, "333m"), (1.1, 110, "100m")],
)
def test_the_spill_budget_is_the_physical_share_rounded_down(
    pods: Pods, tmp_path: Path, scaling: float, mib: int, budget: str
) -> None:
    pods.add("p", {"main": [("GPU-a", mib, 0)]})
    cfg = NodeConfig(split=4, device_memory_scaling=scaling, oversubscribe=True)
    envs = dict(make(pods, tmp_path, cfg).allocate_container(["GPU-a::0"]).response.envs)
    assert envs["CUDA_DEVICE_MEMORY_BUDGET_0"] == budget


@pytest.mark.parametrize(
    "cfg",
    [
        NodeConfig(split=4),
        NodeConfig(split=4, oversubscribe=True),
        NodeConfig(split=4, device_memory_scaling=0.9),
    ],
    ids=["no-spill", "spill-without-scaling", "scaled-down"],
)
def test_no_budget_unless_the_node_promises_more_memory_than_it_has(
    pods: Pods, tmp_path: Path, cfg: NodeConfig
) -> None:
    pods.add("p", {"main": [("GPU-a", 1000, 0)]})
    envs = dict(make(pods, tmp_path, cfg).allocate_container(["GPU-a::0"]).response.envs)
    assert not any(k.startswith("CUDA_DEVICE_MEMORY_BUDGET") for k in envs)


def test_the_node_sm_policy_reaches_the_hook(pods: Pods, tmp_path: Path) -> None:
    pods.add("p", {"main": [("GPU-a", 1000, 30)]})
    cfg = NodeConfig(split=4, sm_policy="elastic")
    envs = dict(make(pods, tmp_path, cfg).allocate_container(["GPU-a::0"]).response.envs)
    assert envs["CUDA_SM_POLICY"] == "elastic"


def test_containers_are_served_in_kubelets_order_and_the_pod_is_marked_when_all_are(
    pods: Pods, tmp_path: Path
) -> None:
    pods.add(
        "p",
        {"setup": [("GPU-a", 100, 0)], "train": [("GPU-b", 200, 50)], "eval": [("GPU-c", 300, 0)]},
        init=("setup",),
    )
    alloc = make(pods, tmp_path)
    got = [alloc.allocate_container(["GPU-a::0"]).container for _ in range(2)]
    assert got == ["setup", "train"]
    assert pods.phase("p") == "bound"
    last = alloc.allocate_container(["GPU-a::1"])
    assert last.container == "eval"
    assert dict(last.response.envs)["CUDA_DEVICE_MEMORY_LIMIT_0"] == "300m"
    assert pods.phase("p") == "allocated"


def test_with_several_pods_waiting_the_oldest_is_served_first(pods: Pods, tmp_path: Path) -> None:
    pods.add("young", {"main": [("GPU-a", 1000, 0)]}, created="2026-01-01T00:00:09Z")
    pods.add("old", {"main": [("GPU-a", 2000, 0)]}, created="2026-01-01T00:00:01Z")
    pods.add("two", {"main": [("GPU-a", 1, 0), ("GPU-b", 1, 0)]}, created="2026-01-01T00:00:00Z")
    alloc = make(pods, tmp_path)
    assert alloc.allocate_container(["GPU-a::0"]).pod == "old"  # "two" asks for 2 vGPUs, not 1
    assert alloc.allocate_container(["GPU-a::1"]).pod == "young"
    assert alloc.allocate_container(["GPU-a::2", "GPU-b::0"]).pod == "two"
    assert [pods.phase(n) for n in ("young", "old", "two")] == ["allocated"] * 3


def test_the_device_ids_kubelet_passes_do_not_pick_the_pod(pods: Pods, tmp_path: Path) -> None:
    # kubelet's IDs are interchangeable slots: IDs on the younger pod's card still serve the
    # pod kubelet admits first (the defect: the card match handed "old" the limits of "new")
    pods.add("old", {"main": [("GPU-a", 1000, 0)]}, created="2026-01-01T00:00:01Z")
    pods.add("new", {"main": [("GPU-c", 2000, 0)]}, created="2026-01-01T00:00:02Z")
    alloc = make(pods, tmp_path)
    first = alloc.allocate_container(["GPU-c::3"])
    assert (first.pod, dict(first.response.envs)["CUDA_DEVICE_MEMORY_LIMIT_0"]) == ("old", "1000m")
    second = alloc.allocate_container(["GPU-a::0"])
    assert (second.pod, dict(second.response.envs)["CUDA_DEVICE_MEMORY_LIMIT_0"]) == ("new", "2000m")


def test_the_pod_that_arrived_first_is_served_first_whatever_its_creation_time(
    pods: Pods, tmp_path: Path
) -> None:
    arrivals = Arrivals()
    alloc = make(pods, tmp_path, arrivals=arrivals)
    late = pods.add(
        "created-first-bound-last", {"main": [("GPU-a", 1000, 0)]}, created="2026-01-01T00:00:01Z"
    )
    early = pods.add(
        "created-last-bound-first", {"main": [("GPU-b", 2000, 0)]}, created="2026-01-01T00:00:05Z"
    )
    arrivals.observe([early])  # the watch saw this Binding first
    arrivals.observe([late])
    assert alloc.allocate_container(["GPU-a::0"]).pod == "created-last-bound-first"
    assert alloc.allocate_container(["GPU-b::0"]).pod == "created-first-bound-last"


def test_pods_that_arrived_together_go_by_creation_time(pods: Pods, tmp_path: Path) -> None:
    arrivals = Arrivals()
    alloc = make(pods, tmp_path, arrivals=arrivals)
    a = pods.add("b-older", {"main": [("GPU-a", 1000, 0)]}, created="2026-01-01T00:00:01Z")
    b = pods.add("a-younger", {"main": [("GPU-b", 2000, 0)]}, created="2026-01-01T00:00:02Z")
    arrivals.observe([b, a])  # one list: kubelet sorts such a batch by creationTimestamp
    assert [alloc.allocate_container(["GPU-c::0"]).pod for _ in range(2)] == ["b-older", "a-younger"]


def test_indistinguishable_pods_with_different_limits_are_refused_and_none_is_touched(
    pods: Pods, tmp_path: Path
) -> None:
    pods.add("twin-a", {"main": [("GPU-a", 1000, 10)]})
    pods.add("twin-b", {"main": [("GPU-a", 3000, 10)]})
    alloc = make(pods, tmp_path)
    alloc.tie_wait_s = 0
    with pytest.raises(AllocateError) as info:
        alloc.allocate_container(["GPU-a::0"])
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "default/twin-a, default/twin-b" in str(info.value) and "created in the same second" in str(
        info.value
    )
    assert pods.patches == []
    assert not (tmp_path / "var/lib/vgpu/containers").exists() or not any(
        (tmp_path / "var/lib/vgpu/containers").iterdir()
    )


def test_indistinguishable_pods_with_the_same_limits_on_the_same_card_are_served(
    pods: Pods, tmp_path: Path
) -> None:
    pods.add("replica-1", {"main": [("GPU-a", 1000, 10)]})
    pods.add("replica-2", {"main": [("GPU-a", 1000, 10)]})
    alloc = make(pods, tmp_path)
    alloc.tie_wait_s = 0
    served = [alloc.allocate_container(["GPU-a::0"]) for _ in range(2)]
    assert sorted(s.pod for s in served) == ["replica-1", "replica-2"]
    assert {dict(s.response.envs)["CUDA_DEVICE_MEMORY_LIMIT_0"] for s in served} == {"1000m"}


def test_a_tie_resolves_once_kubelet_marks_the_pod_it_rejected_failed(pods: Pods, tmp_path: Path) -> None:
    pods.add("rejected", {"main": [("GPU-a", 1000, 0)]})
    pods.add("admitted", {"main": [("GPU-b", 3000, 0)]})
    alloc = make(pods, tmp_path)
    alloc.tie_wait_s = 5.0
    timer = threading.Timer(0.3, lambda: pods.pods[0].setdefault("status", {}).update(phase="Failed"))
    timer.start()
    try:
        served = alloc.allocate_container(["GPU-b::0"])
    finally:
        timer.cancel()
    assert (served.pod, dict(served.response.envs)["CUDA_DEVICE_MEMORY_LIMIT_0"]) == ("admitted", "3000m")


def test_a_pod_kubelet_rejected_is_no_longer_waiting(pods: Pods, tmp_path: Path) -> None:
    pods.add("rejected", {"main": [("GPU-a", 1000, 0)]}, created="2026-01-01T00:00:01Z")
    pods.add("next", {"main": [("GPU-b", 2000, 0)]}, created="2026-01-01T00:00:02Z")
    pods.pods[0]["status"] = {"phase": "Failed", "reason": "UnexpectedAdmissionError"}
    assert make(pods, tmp_path).allocate_container(["GPU-a::0"]).pod == "next"


def test_a_half_served_pod_is_finished_before_an_earlier_arrival_starts(pods: Pods, tmp_path: Path) -> None:
    arrivals = Arrivals()
    alloc = make(pods, tmp_path, arrivals=arrivals)
    early = pods.add("early", {"main": [("GPU-a", 100, 0)]})
    half = pods.add("half", {"one": [("GPU-b", 200, 0)], "two": [("GPU-c", 300, 0)]})
    arrivals.observe([early])
    arrivals.observe([half])
    (tmp_path / f"var/lib/vgpu/containers/{half}_one").mkdir(parents=True)  # served before a restart
    served = alloc.allocate_container(["GPU-a::0"])
    assert (served.pod, served.container) == ("half", "two")


def test_after_kubelet_restarts_the_waiting_pods_go_by_creation_time(pods: Pods, tmp_path: Path) -> None:
    arrivals = Arrivals()
    alloc = make(pods, tmp_path, arrivals=arrivals)
    young = pods.add("young", {"main": [("GPU-a", 100, 0)]}, created="2026-01-01T00:00:09Z")
    old = pods.add("old", {"main": [("GPU-b", 200, 0)]}, created="2026-01-01T00:00:01Z")
    arrivals.observe([young])
    arrivals.observe([old])
    arrivals.rebatch()  # kubelet lists them anew, as one batch
    assert alloc.allocate_container(["GPU-a::0"]).pod == "old"


def test_allocate_serves_the_container_get_preferred_allocation_answered_for(
    pods: Pods, tmp_path: Path
) -> None:
    arrivals = Arrivals()
    alloc = make(pods, tmp_path, arrivals=arrivals)
    first = pods.add("first", {"main": [("GPU-c", 1000, 0)]}, created="2026-01-01T00:00:05Z")
    arrivals.observe([first])
    available = [f"GPU-{c}::{n}" for c in "abcd" for n in range(4)]
    ids = alloc.preferred(available, [], 1)
    assert [i.split("::")[0] for i in ids] == ["GPU-c"]  # the card the scheduler chose
    # before Allocate comes, the plugin learns of an older pod that now heads the queue
    older = pods.add("older", {"main": [("GPU-a", 2000, 0)]}, created="2026-01-01T00:00:01Z")
    arrivals.observe([older])
    arrivals.rebatch()
    served = alloc.allocate_container(ids)
    assert (served.pod, dict(served.response.envs)["NVIDIA_VISIBLE_DEVICES"]) == ("first", "GPU-c")
    # the answer is used once: other IDs go by the queue again
    assert alloc.allocate_container(ids).pod == "older"


def test_arrivals_wait_for_the_watch_and_rank_what_it_never_delivered_last() -> None:
    arrivals = Arrivals()
    arrivals.watched = True
    arrivals.observe(["a"])
    threading.Timer(0.1, lambda: arrivals.observe(["b"])).start()
    ranks = arrivals.ranks(["c", "b", "a"], wait_s=0.5)
    assert ranks["a"] < ranks["b"] < ranks["c"]  # "c" never came: ranked after all, once waited for
    arrivals.retain(["c"])
    assert arrivals.rank("a") is None and arrivals.rank("c") == ranks["c"]


def test_a_malformed_annotation_refuses_allocate_and_touches_nothing(pods: Pods, tmp_path: Path) -> None:
    pods.add("bad", {"main": [("GPU-a", 1000, 0)]}, annotation='{"version": 1, "node": "node-a"')
    with pytest.raises(AllocateError) as info:
        make(pods, tmp_path).allocate_container(["GPU-a::0"])
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "default/bad" in str(info.value) and "not valid JSON" in str(info.value)
    assert pods.patches == []
    assert pods.phase("bad") == "bound"


def test_a_wrong_version_is_named_in_the_refusal(pods: Pods, tmp_path: Path) -> None:
    pods.add("v2", {}, annotation=json.dumps({"version": 2, "node": NODE, "containers": []}))
    with pytest.raises(AllocateError, match="unsupported version 2"):
        make(pods, tmp_path).allocate_container(["GPU-a::0"])


def test_no_waiting_pod_refuses_allocate(pods: Pods, tmp_path: Path) -> None:
    with pytest.raises(AllocateError, match="no pod bound to node node-a"):
        make(pods, tmp_path).allocate_container(["GPU-a::0"])


def test_unknown_device_ids_are_refused_as_invalid(pods: Pods, tmp_path: Path) -> None:
    with pytest.raises(AllocateError) as info:
        make(pods, tmp_path).allocate_container(["GPU-z::0"])
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_card_not_on_this_node_fails_the_pod_with_a_reason(pods: Pods, tmp_path: Path) -> None:
    pods.add("p", {"main": [("GPU-elsewhere", 1000, 0)]})
    with pytest.raises(AllocateError, match="card GPU-elsewhere, which is not a card of this node"):
        make(pods, tmp_path).allocate_container(["GPU-a::0"])
    assert pods.phase("p") == "failed"
    assert "GPU-elsewhere" in (pods.patches[-1][1][REASON_ANNOTATION] or "")


def test_a_card_gone_after_the_check_fails_the_pod_with_a_reason(pods: Pods, tmp_path: Path) -> None:
    pods.add("p", {"main": [("GPU-b", 1000, 0)]})
    alloc = make(pods, tmp_path)
    real = alloc.state.card
    alloc.state.card = lambda uuid: None if uuid == "GPU-b" else real(uuid)  # type: ignore[method-assign]
    with pytest.raises(AllocateError, match="not on node node-a"):
        alloc.allocate_container(["GPU-a::0"])
    assert pods.phase("p") == "failed"


def test_an_unhealthy_card_fails_the_pod(pods: Pods, tmp_path: Path) -> None:
    pods.add("p", {"main": [("GPU-b", 1000, 0)]})
    alloc = make(pods, tmp_path)
    alloc.state.set_health("GPU-b", False)
    with pytest.raises(AllocateError, match="unhealthy"):
        alloc.allocate_container(["GPU-a::0"])
    assert pods.phase("p") == "failed"


def test_without_a_hook_library_only_the_region_folder_and_the_grant_are_mounted(
    pods: Pods, tmp_path: Path
) -> None:
    pods.add("p", {"main": [("GPU-a", 1000, 0)]})
    served = make(pods, tmp_path, NodeConfig(split=4, driver_inject="cdi"), hook=False).allocate_container(
        ["GPU-a::0"]
    )
    mounts = [m.container_path for m in served.response.mounts]
    assert mounts == ["/var/lib/vgpu/containers/uid-p_main", "/etc/vgpu/limits"]


@pytest.mark.parametrize("inject", ["runtime", "cdi"])
def test_the_cards_reach_the_container_by_mounts_or_cdi_names_never_by_its_environment(
    pods: Pods, tmp_path: Path, inject: str
) -> None:
    """A tenant sets its container's environment, never its mounts or CDI devices: the cards a
    container gets are named where only Allocate's answer reaches (vgpu/node/inject.py)."""
    pods.add("p", {"main": [("GPU-b", 1000, 0), ("GPU-c", 1000, 0)]})
    config = NodeConfig(split=4, driver_inject=inject, cdi_kind="example.com/gpu")
    response = make(pods, tmp_path, config).allocate_container(["GPU-b::0", "GPU-c::0"]).response
    volume = [
        (m.container_path, m.host_path, m.read_only)
        for m in response.mounts
        if "container-devices" in m.container_path
    ]
    if inject == "runtime":
        assert volume == [
            ("/var/run/nvidia-container-devices/GPU-b", "/dev/null", True),
            ("/var/run/nvidia-container-devices/GPU-c", "/dev/null", True),
        ]
        assert not response.cdi_devices
    else:
        assert [d.name for d in response.cdi_devices] == ["example.com/gpu=GPU-b", "example.com/gpu=GPU-c"]
        assert not volume


def test_a_restarted_plugin_continues_a_half_served_pod_from_its_folders(pods: Pods, tmp_path: Path) -> None:
    pods.add("p", {"first": [("GPU-a", 100, 0)], "second": [("GPU-b", 200, 0)]})
    assert make(pods, tmp_path).allocate_container(["GPU-a::0"]).container == "first"
    restarted = Allocator(NODE, pods, DeviceState(CARDS, NodeConfig(split=4)), HostPaths(tmp_path), None)
    served = restarted.allocate_container(["GPU-b::0"])
    assert served.container == "second"
    assert pods.phase("p") == "allocated"


def test_preferred_ids_are_on_the_cards_of_the_next_container_to_start(pods: Pods, tmp_path: Path) -> None:
    pods.add("p", {"one": [("GPU-c", 100, 0)], "two": [("GPU-d", 1, 0), ("GPU-a", 1, 0)]})
    alloc = make(pods, tmp_path)
    available = [f"GPU-{c}::{n}" for c in "abcd" for n in range(4)]
    assert alloc.preferred(available, [], 1) == ["GPU-c::0"]
    assert len({i.split("::")[0] for i in alloc.preferred(available, [], 3)}) == 3  # no such container
    alloc.allocate_container(["GPU-c::0"])
    assert alloc.preferred(available, [], 2) == ["GPU-d::0", "GPU-a::0"]


def test_a_bound_pod_without_its_allocation_is_named_as_missing(pods: Pods, tmp_path: Path) -> None:
    pods.add("lost", {"main": [("GPU-a", 1000, 0)]})
    del pods.pods[0]["metadata"]["annotations"][ALLOCATION_ANNOTATION]
    with pytest.raises(
        AllocateError, match=r"default/lost \(vgpu.openaios.io/allocation: annotation is missing"
    ):
        make(pods, tmp_path).allocate_container(["GPU-a::0"])
    assert pods.patches == []


def test_a_pod_placed_by_another_scheduler_is_named_in_the_refusal(pods: Pods, tmp_path: Path) -> None:
    pods.add("foreign", {"main": [("GPU-a", 1000, 0)]})
    pods.pods[0]["metadata"]["annotations"] = {}
    with pytest.raises(AllocateError, match="default/foreign .*not placed by the vgpu scheduler"):
        make(pods, tmp_path).allocate_container(["GPU-a::0"])
    assert pods.patches == []


def test_the_region_folder_is_writable_by_any_container_user_but_unreachable_on_the_host(
    pods: Pods, tmp_path: Path
) -> None:
    uid = pods.add("p", {"main": [("GPU-a", 1000, 0)]})
    make(pods, tmp_path).allocate_container(["GPU-a::0"])
    assert (tmp_path / f"var/lib/vgpu/containers/{uid}_main").stat().st_mode & 0o777 == 0o777
    # The parent is root's alone, so no other host user can reach the open folder.
    assert (tmp_path / "var/lib/vgpu/containers").stat().st_mode & 0o777 == 0o700


def test_an_unwritable_host_folder_is_an_internal_error_and_the_container_can_be_retried(
    pods: Pods, tmp_path: Path
) -> None:
    pods.add("p", {"main": [("GPU-a", 1000, 0)]})
    alloc = make(pods, tmp_path)
    containers = tmp_path / "var/lib/vgpu/containers"
    containers.parent.mkdir(parents=True, exist_ok=True)
    containers.write_text("a file where a folder should be")
    with pytest.raises(AllocateError) as info:
        alloc.allocate_container(["GPU-a::0"])
    assert info.value.code == grpc.StatusCode.INTERNAL and "is writable" in str(info.value)
    assert pods.phase("p") == "bound"
    containers.unlink()
    assert alloc.allocate_container(["GPU-a::0"]).container == "main"
    assert pods.phase("p") == "allocated"


# -- the tenant boundary: a placement that is not what the pod asks for is refused ---------------


def forge(pods: Pods, name: str, limits: dict[str, str], devices: list[tuple[str, int, int]]) -> None:
    """A pod whose own spec asks for ``limits`` but whose allocation gives ``devices``: what a
    tenant who wrote its own placement annotation gets past a cluster without the admission policy."""
    pods.add(name, {"main": devices})
    pod = pods.find("default", name)
    assert pod is not None
    pod["spec"]["containers"][0]["resources"]["limits"] = limits


def test_a_forged_grant_with_no_limit_is_refused_and_the_pod_told_why_once(
    pods: Pods, tmp_path: Path
) -> None:
    forge(pods, "forged", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"}, [("GPU-a", 0, 0)])
    alloc = make(pods, tmp_path)
    with pytest.raises(AllocateError) as err:
        alloc.allocate_container(["GPU-a::0"])
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "default/forged (vgpu.openaios.io/allocation: container main is given 0 MiB on card GPU-a" in str(
        err.value
    )
    assert pods.phase("forged") == "failed"
    with pytest.raises(AllocateError):  # kubelet rejected it; a later Allocate finds no pod
        alloc.allocate_container(["GPU-a::0"])
    ((name, reason, message),) = pods.pod_events  # once, not at every Allocate
    assert (name, reason) == ("forged", "VgpuPlacementRefused")
    assert "asks for 1000 MiB (nvidia.com/gpumem 1000)" in message
    assert "written by the vgpu scheduler alone" in message
    assert not list((tmp_path / "var/lib/vgpu/grants").glob("*.limits"))  # no grant was written


def test_a_neighbour_with_an_honest_placement_is_served_beside_a_forged_one(
    pods: Pods, tmp_path: Path
) -> None:
    forge(pods, "forged", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"}, [("GPU-a", 80000, 100)])
    pods.add("honest", {"main": [("GPU-a", 1000, 30)]}, created="2026-01-01T00:00:05Z")
    served = make(pods, tmp_path).allocate_container(["GPU-a::1"])
    assert (served.pod, dict(served.response.envs)["CUDA_DEVICE_MEMORY_LIMIT_0"]) == ("honest", "1000m")
    assert pods.phase("forged") == "failed"


def test_a_pod_asking_only_for_a_card_gets_the_node_config_defaults_the_scheduler_applied(
    pods: Pods, tmp_path: Path
) -> None:
    forge(pods, "whole", {"nvidia.com/gpu": "1"}, [("GPU-a", 80000, 0)])
    forge(pods, "defaulted", {"nvidia.com/gpu": "1"}, [("GPU-b", 4096, 25)])
    whole = make(pods, tmp_path).allocate_container(["GPU-a::0"])
    assert dict(whole.response.envs)["CUDA_DEVICE_MEMORY_LIMIT_0"] == "80000m"
    assert pods.phase("defaulted") == "failed"  # the node's defaults (none) say the whole card
    defaults = NodeConfig(default_mem=4096, default_cores=25)
    pods.find("default", "defaulted")["metadata"]["annotations"][PHASE_ANNOTATION] = "bound"  # type: ignore[index]
    served = make(pods, tmp_path / "again", defaults).allocate_container(["GPU-b::0"])
    assert dict(served.response.envs)["CUDA_DEVICE_SM_LIMIT_0"] == "25"


def test_a_spec_the_parser_refuses_gets_no_grant(pods: Pods, tmp_path: Path) -> None:
    forge(pods, "bad", {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "300"}, [("GPU-a", 80000, 100)])
    with pytest.raises(AllocateError, match=r"default/bad \(its spec: .*gpucores.*must be 0\.\.100"):
        make(pods, tmp_path).allocate_container(["GPU-a::0"])
    assert pods.phase("bad") == "failed"


def test_a_pod_refused_at_the_preferred_allocation_is_still_named_by_allocate(
    pods: Pods, tmp_path: Path
) -> None:
    """kubelet asks GetPreferredAllocation first: the refusal marks the pod failed there, and the
    Allocate that follows must still say why, for kubelet to put on the pod."""
    forge(pods, "forged", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"}, [("GPU-a", 0, 0)])
    alloc = make(pods, tmp_path)
    alloc.preferred(["GPU-a::0", "GPU-b::0"], [], 1)
    assert pods.phase("forged") == "failed"
    with pytest.raises(
        AllocateError, match=r"default/forged \(vgpu.openaios.io/allocation: container main is given 0 MiB"
    ):
        alloc.allocate_container(["GPU-a::0"])
