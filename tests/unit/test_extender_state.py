"""The extender's state as the watches feed it: rebuilt from annotations, freed on delete, never stale."""

from __future__ import annotations

import datetime as dt
from typing import Any

from vgpu import annotations as ann
from vgpu.config import SchedulerConfig
from vgpu.extender.state import SchedulerState
from vgpu.ledger import Usage

CFG = SchedulerConfig()
NOW = 2_000_000.0


def alloc_pod(uid: str, rv: int, node: str = "a", mem: int = 3000, phase: str = "Running") -> dict[str, Any]:
    allocation = ann.Allocation(
        node, (ann.ContainerAllocation("main", (ann.DeviceAllocation("GPU-0", mem, 10),)),)
    )
    annotations = {ann.ALLOCATION_ANNOTATION: ann.encode_allocation(allocation)}
    return {
        "metadata": {
            "uid": uid,
            "name": uid,
            "namespace": "d",
            "resourceVersion": str(rv),
            "annotations": annotations,
        },
        "spec": {"containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpumem": str(mem)}}}]},
        "status": {"phase": phase},
    }


def state() -> SchedulerState:
    return SchedulerState(CFG, clock=lambda: NOW)


def test_the_ledger_is_rebuilt_from_the_pods_allocation_annotations() -> None:
    st = state()
    st.replace_pods([alloc_pod("u1", 5), alloc_pod("u2", 6, mem=1000)])
    assert st.ledger.usage("a") == {"GPU-0": Usage(4000, 20, 2, 0)}


def test_a_deleted_pod_frees_its_capacity() -> None:
    st = state()
    st.apply_pod(alloc_pod("u1", 5))
    st.apply_pod(alloc_pod("u1", 7), deleted=True)
    assert st.ledger.usage("a") == {}


def test_a_finished_pod_frees_its_capacity() -> None:
    st = state()
    st.apply_pod(alloc_pod("u1", 5))
    st.apply_pod(alloc_pod("u1", 6, phase="Succeeded"))
    assert st.ledger.usage("a") == {}


def test_an_event_without_the_allocation_never_frees_capacity() -> None:
    st = state()
    st.apply_pod(alloc_pod("u1", 10))
    late = alloc_pod("u1", 9)
    del late["metadata"]["annotations"][ann.ALLOCATION_ANNOTATION]
    st.apply_pod(late)  # e.g. the watch delivering the pod as it was before our bind
    assert st.ledger.node_of("u1") == "a"
    newer = alloc_pod("u1", 11)
    del newer["metadata"]["annotations"][ann.ALLOCATION_ANNOTATION]
    st.apply_pod(newer)
    assert st.ledger.node_of("u1") == "a"


def test_an_event_older_than_what_the_ledger_reflects_is_ignored() -> None:
    st = state()
    st.apply_pod(alloc_pod("u1", 10, phase="Succeeded"))
    st.apply_pod(alloc_pod("u1", 9))  # the running pod, delivered after it finished
    assert st.ledger.node_of("u1") is None


def test_a_relist_forgets_pods_that_are_gone_but_keeps_binds_in_flight() -> None:
    st = state()
    st.replace_pods([alloc_pod("u1", 5), alloc_pod("u2", 6)])
    st.binding.add("u2")
    st.replace_pods([])
    assert st.ledger.pods() == {"u2": "a"}


def test_a_malformed_allocation_is_not_counted_and_does_not_raise() -> None:
    st = state()
    pod = alloc_pod("u1", 5)
    pod["metadata"]["annotations"][ann.ALLOCATION_ANNOTATION] = '{"version": 2}'
    st.apply_pod(pod)
    assert st.ledger.pods() == {}


def test_an_init_container_larger_than_the_app_counts_once_not_twice() -> None:
    st = state()
    pod = alloc_pod("u1", 5)
    allocation = ann.Allocation(
        "a",
        (
            ann.ContainerAllocation("init", (ann.DeviceAllocation("GPU-0", 5000, 0),)),
            ann.ContainerAllocation("main", (ann.DeviceAllocation("GPU-0", 3000, 10),)),
        ),
    )
    pod["metadata"]["annotations"][ann.ALLOCATION_ANNOTATION] = ann.encode_allocation(allocation)
    pod["spec"]["initContainers"] = [{"name": "init", "resources": {"limits": {"nvidia.com/gpumem": "5000"}}}]
    st.apply_pod(pod)
    assert st.ledger.usage("a") == {"GPU-0": Usage(5000, 10, 1, 0)}


def lease(name: str, renewed: float, duration: int = 10) -> dict[str, Any]:
    t = dt.datetime.fromtimestamp(renewed, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {"metadata": {"name": name}, "spec": {"renewTime": t, "leaseDurationSeconds": duration}}


def test_a_node_is_usable_only_while_its_plugin_lease_is_fresh() -> None:
    st = state()
    inv = ann.encode_devices(ann.NodeInventory((ann.Device("GPU-0", 0, "m", 1000, 100, 2),)))
    st.apply_node({"metadata": {"name": "a", "annotations": {ann.DEVICES_ANNOTATION: inv}}})
    assert "not found" in (st.node_problem("a", NOW) or "")
    st.apply_lease(lease("vgpu-a", NOW - 5))
    assert st.node_problem("a", NOW) is None
    st.apply_lease(lease("vgpu-a", NOW - 60))
    assert "expired" in (st.node_problem("a", NOW) or "")
    st.apply_lease(lease("vgpu-a", NOW), deleted=True)
    assert st.node_problem("a", NOW) is not None


def test_the_extenders_own_lease_is_not_mistaken_for_a_node() -> None:
    st = state()
    st.apply_lease(lease(CFG.leader_lease, NOW))
    assert st.lease_expiry == {}


def test_a_node_whose_inventory_is_fixed_is_used_again() -> None:
    st = state()
    st.apply_node({"metadata": {"name": "a", "annotations": {ann.DEVICES_ANNOTATION: "garbage"}}})
    assert "malformed" in (st.node_problem("a", NOW) or "")
    inv = ann.encode_devices(ann.NodeInventory((ann.Device("GPU-0", 0, "m", 1000, 100, 2),)))
    st.apply_node({"metadata": {"name": "a", "annotations": {ann.DEVICES_ANNOTATION: inv}}})
    st.apply_lease(lease("vgpu-a", NOW))
    assert st.node_problem("a", NOW) is None and st.inventory_errors == 1


def test_card_gauges_show_capacity_and_what_is_committed_and_skip_unchanged_nodes() -> None:
    from vgpu.extender import metrics
    from vgpu.extender.sync import refresh_gauges

    st = state()
    inv = ann.encode_devices(ann.NodeInventory((ann.Device("GPU-g", 0, "m", 1000, 100, 4),)))
    st.apply_node({"metadata": {"name": "gauged", "annotations": {ann.DEVICES_ANNOTATION: inv}}})
    st.ledger.commit("u1", "gauged", {"GPU-g": Usage(300, 20, 1, 0)})
    seen: dict[str, tuple[int, int]] = {}
    refresh_gauges(st, metrics, seen)
    mib = 1024 * 1024
    assert metrics.CARD_MEMORY_CAPACITY.labels("gauged", "GPU-g")._value.get() == 1000 * mib
    assert metrics.CARD_MEMORY_ALLOCATED.labels("gauged", "GPU-g")._value.get() == 300 * mib
    assert metrics.CARD_CORES_ALLOCATED.labels("gauged", "GPU-g")._value.get() == 0.2
    assert metrics.CARD_VGPUS_ALLOCATED.labels("gauged", "GPU-g")._value.get() == 1
    assert st.snapshot(changed_since=seen) == []  # nothing changed: nothing to rewrite
    st.ledger.release("u1")
    refresh_gauges(st, metrics, seen)
    assert metrics.CARD_MEMORY_ALLOCATED.labels("gauged", "GPU-g")._value.get() == 0
