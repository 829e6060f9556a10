"""The extender's state as the watches feed it: rebuilt from annotations, freed on delete, never stale."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from tests.support import FakeKube
from vgpu.core import annotations as ann
from vgpu.core.config import SchedulerConfig
from vgpu.core.ledger import Usage
from vgpu.extender.state import ASSUME_TTL_S, NUDGE_WINDOW_S, SchedulerState

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
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "resources": {"limits": {"nvidia.com/gpumem": str(mem), "nvidia.com/gpucores": "10"}},
                }
            ]
        },
        "status": {"phase": phase},
    }


def state(*nodes: str) -> SchedulerState:
    """A state that knows the Nodes named (``alloc_pod``'s "a" by default, no inventory): the
    ledger books pods only on Nodes that exist."""
    st = SchedulerState(CFG, clock=lambda: NOW)
    for name in nodes or ("a",):
        st.apply_node({"metadata": {"name": name}})
    return st


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


def _untrusted(kind: str) -> float:
    from vgpu.extender import metrics

    return metrics.UNTRUSTED_PLACEMENTS.labels(kind)._value.get()


def test_an_allocation_changed_after_the_booking_is_not_a_new_booking() -> None:
    """A running tenant that rewrites its own placement to shrink it keeps its booking: its
    neighbours are never placed on top of what it holds."""
    st = state()
    st.apply_pod(alloc_pod("u1", 5, mem=30000))
    before = _untrusted("changed")
    st.apply_pod(alloc_pod("u1", 6, mem=1))
    assert st.ledger.usage("a") == {"GPU-0": Usage(30000, 10, 1, 0)}
    assert _untrusted("changed") == before + 1
    st.apply_pod(alloc_pod("u1", 7, mem=1))  # the same change again: warned once
    assert _untrusted("changed") == before + 1


def test_after_a_restart_a_placement_that_is_not_what_the_pod_asks_for_is_booked_at_what_it_asks() -> None:
    st = state()
    inv = ann.encode_devices(ann.NodeInventory((ann.Device("GPU-0", 0, "m", 80000, 100, 4),)))
    st.apply_node({"metadata": {"name": "a", "annotations": {ann.DEVICES_ANNOTATION: inv}}})
    forged = alloc_pod("u1", 5, mem=0)  # a grant of no memory for a pod whose spec asks for 20000
    forged["spec"]["containers"][0]["resources"]["limits"] = {
        "nvidia.com/gpumem": "20000",
        "nvidia.com/gpucores": "10",
    }
    before = _untrusted("mismatch")
    st.replace_pods([forged, alloc_pod("u2", 6, mem=3000)])
    assert st.ledger.usage("a") == {"GPU-0": Usage(20000 + 3000, 20, 2, 0)}
    assert _untrusted("mismatch") == before + 1


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
    seen: dict[str, tuple[int, int, tuple[str, ...]]] = {}
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


def test_each_cards_mode_is_a_gauge_series_that_follows_the_inventory() -> None:
    from vgpu.extender import metrics
    from vgpu.extender.sync import refresh_gauges

    def inventory(sharing: str) -> dict[str, Any]:
        cards = (
            ann.Device("GPU-m", 0, "m", 1000, 100, 4, sharing=sharing),
            ann.Device("GPU-t", 1, "m", 1000, 100, 4),
        )
        return {
            "metadata": {
                "name": "moded",
                "annotations": {ann.DEVICES_ANNOTATION: ann.encode_devices(ann.NodeInventory(cards))},
            }
        }

    def series() -> dict[tuple[str, str], float]:
        return {
            (s.labels["uuid"], s.labels["mode"]): s.value
            for metric in metrics.CARD_MODE.collect()
            for s in metric.samples
            if s.labels["node"] == "moded"
        }

    st = state()
    st.apply_node(inventory("mps"))
    seen: dict[str, tuple[int, int, tuple[str, ...]]] = {}
    refresh_gauges(st, metrics, seen)
    assert series() == {("GPU-m", "mps"): 1, ("GPU-t", "hami-core"): 1}
    st.apply_node(inventory("timeslice"))  # the node turned MPS off: the mps series goes
    refresh_gauges(st, metrics, seen)
    assert series() == {("GPU-m", "hami-core"): 1, ("GPU-t", "hami-core"): 1}
    st.forget_node("moded")
    refresh_gauges(st, metrics, seen)
    assert series() == {}


# -- a deleted Node: out of the ledger and the gauges ---------------------------------------------


def _inventoried(name: str, *uuids: str) -> dict[str, Any]:
    inv = ann.NodeInventory(tuple(ann.Device(u, i, "m", 80000, 100, 4) for i, u in enumerate(uuids)))
    return {"metadata": {"name": name, "annotations": {ann.DEVICES_ANNOTATION: ann.encode_devices(inv)}}}


def test_a_deleted_node_leaves_the_ledger_and_its_pods_are_booked_again_if_it_comes_back() -> None:
    st = state("a", "b")
    st.apply_pod(alloc_pod("u1", 5))
    st.apply_pod(alloc_pod("u2", 6, node="b"))
    st.forget_node("a")  # kubectl delete node a; pod GC has not deleted u1 yet
    assert st.ledger.pods() == {"u2": "b"} and st.ledger.usage("a") == {} and "a" not in st.ledger.nodes()
    assert st.parked == {"a": {"u1": {"GPU-0": Usage(3000, 10, 1, 0)}}}
    st.apply_pod(alloc_pod("u1", 7))  # a status update of the pod: still nothing booked on a
    assert st.ledger.node_of("u1") is None
    st.apply_node({"metadata": {"name": "a"}})  # the Node registered again, its pod still there
    assert st.ledger.usage("a") == {"GPU-0": Usage(3000, 10, 1, 0)} and st.parked == {}
    st.replace_nodes([{"metadata": {"name": "b"}}])  # a relist without a: the same as its deletion
    assert st.ledger.pods() == {"u2": "b"}
    st.apply_pod(alloc_pod("u1", 8), deleted=True)  # pod GC deletes it
    assert st.parked == {}
    st.apply_node({"metadata": {"name": "a"}})
    assert st.ledger.usage("a") == {}


def test_pods_listed_before_their_node_are_booked_when_the_node_is_listed() -> None:
    st = state("b")
    st.replace_pods([alloc_pod("u1", 5, node="c"), alloc_pod("u2", 6, node="b")])
    assert st.ledger.pods() == {"u2": "b"}
    st.replace_nodes([{"metadata": {"name": "b"}}, {"metadata": {"name": "c"}}])
    assert st.ledger.pods() == {"u1": "c", "u2": "b"}
    st.replace_pods([alloc_pod("u2", 6, node="b")])  # a relist without u1 forgets it, parked or not
    st.forget_node("c")
    st.apply_node({"metadata": {"name": "c"}})
    assert st.ledger.pods() == {"u2": "b"}


def _series(gauge: Any) -> set[tuple[str, ...]]:
    return {tuple(s.labels.values()) for m in gauge.collect() for s in m.samples}


def test_a_deleted_nodes_card_and_node_series_are_removed_and_a_dropped_cards_too() -> None:
    from vgpu.extender import metrics
    from vgpu.extender.sync import refresh_gauges

    st = state()
    st.apply_node(_inventoried("doomed", "GPU-d0", "GPU-d1"))
    st.apply_node(_inventoried("kept", "GPU-k0"))
    st.ledger.commit("u1", "doomed", {"GPU-d0": Usage(30000, 0, 1, 0)})
    seen: dict[str, tuple[int, int, tuple[str, ...]]] = {}
    refresh_gauges(st, metrics, seen)
    assert ("doomed", "GPU-d0") in _series(metrics.CARD_MEMORY_ALLOCATED)
    st.apply_node(_inventoried("kept", "GPU-k1"))  # a card replaced: the old one's series go
    st.forget_node("doomed")
    refresh_gauges(st, metrics, seen)
    for gauge in metrics._CARD_GAUGES:
        assert {labels for labels in _series(gauge) if labels[0] in ("doomed", "kept")} == {
            ("kept", "GPU-k1")
        }
    for gauge in (metrics.NODE_MEMORY_CAPACITY, metrics.NODE_MEMORY_ALLOCATED):
        assert ("doomed",) not in _series(gauge) and ("kept",) in _series(gauge)
    assert set(seen) & {"doomed", "kept"} == {"kept"}


def test_in_multiprocess_mode_a_removed_series_is_left_out_of_what_the_master_serves(tmp_path: Path) -> None:
    """gunicorn's worker writes the metrics to files, and prometheus_client cannot remove a
    series there: the worker marks it (metrics.GONE) and the master's collector leaves it out."""
    from prometheus_client import CollectorRegistry, generate_latest

    from vgpu.extender.server import LiveGauges

    worker = (
        "from vgpu.extender import metrics as m\n"
        "for node, uuid in (('gone', 'GPU-x'), ('kept', 'GPU-y')):\n"
        "    m.CARD_MEMORY_ALLOCATED.labels(node, uuid).set(31457280000)\n"
        "    m.NODE_MEMORY_ALLOCATED.labels(node).set(31457280000)\n"
        "m.forget_card('gone', 'GPU-x')\n"
        "m.forget_node('gone')\n"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", worker], env=env, check=True, timeout=60)
    registry = CollectorRegistry()
    registry.register(LiveGauges(str(tmp_path)))
    served = generate_latest(registry).decode()
    assert 'vgpu_card_memory_allocated_bytes{node="kept",uuid="GPU-y"} 3.145728e+10' in served
    assert 'vgpu_node_memory_allocated_bytes{node="kept"} 3.145728e+10' in served
    assert "gone" not in served and "NaN" not in served


# -- filter keeps only the best few feasible nodes -------------------------------------------------


def _cluster(loads: list[int], keep: int = 3) -> SchedulerState:
    """Nodes n0..: one card of 10000 MiB, split 10, with ``loads[i]`` MiB (and one vGPU) committed."""
    st = SchedulerState(CFG, clock=lambda: NOW, filter_keep=keep)
    for i, load in enumerate(loads):
        inv = ann.encode_devices(ann.NodeInventory((ann.Device(f"GPU-n{i}", 0, "m", 10000, 100, 10),)))
        st.apply_node({"metadata": {"name": f"n{i}", "annotations": {ann.DEVICES_ANNOTATION: inv}}})
        st.apply_lease(lease(f"vgpu-n{i}", NOW))
        if load:
            st.ledger.commit(f"held-{i}", f"n{i}", {f"GPU-n{i}": Usage(load, 0, 1, 0)})
    st.synced.set()
    st.leader.set()
    return st


def _pod(mem: int, uid: str = "p1", policy: str | None = None, containers: int = 1) -> dict[str, Any]:
    meta: dict[str, Any] = {"uid": uid, "name": uid, "namespace": "d"}
    if policy:
        meta["annotations"] = {ann.NODE_POLICY_ANNOTATION: policy}
    spec = [
        {"name": f"c{k}", "resources": {"limits": {"nvidia.com/gpumem": str(mem)}}} for k in range(containers)
    ]
    return {"metadata": meta, "spec": {"containers": spec}}


def test_filter_answers_only_the_fullest_feasible_nodes_under_binpack_in_the_order_given() -> None:
    st = _cluster([0, 5000, 9500, 7000, 2000, 6000], keep=3)
    names = [f"n{i}" for i in range(6)]
    result = st.filter(_pod(1000), names)
    # n2 cannot take 1000 MiB more; of the rest the three fullest are n3, n5, n1
    assert result.nodes == ["n1", "n3", "n5"]
    assert result.unresolvable == {}


def test_filter_answers_only_the_emptiest_feasible_nodes_when_the_pod_asks_for_spread() -> None:
    st = _cluster([0, 5000, 9500, 7000, 2000, 6000], keep=2)
    result = st.filter(_pod(1000, policy="spread"), [f"n{i}" for i in range(6)])
    assert result.nodes == ["n0", "n4"]


def test_filter_keeps_every_feasible_node_when_there_are_no_more_than_it_keeps() -> None:
    st = _cluster([0, 5000, 9500, 7000], keep=3)
    assert st.filter(_pod(1000), ["n0", "n1", "n2", "n3"]).nodes == ["n0", "n1", "n3"]


def test_filter_breaks_ties_by_the_order_kube_scheduler_sent() -> None:
    st = _cluster([0] * 6, keep=2)
    assert st.filter(_pod(1000), ["n4", "n2", "n5", "n0"]).nodes == ["n4", "n2"]


def test_a_pod_that_fits_only_one_of_many_nodes_is_still_offered_it() -> None:
    st = _cluster([9500] * 20 + [0] + [9500] * 20, keep=3)
    result = st.filter(_pod(1000), [f"n{i}" for i in range(41)])
    assert result.nodes == ["n20"] and len(result.failed) == 40


def test_nodes_short_of_memory_give_one_reason_with_the_most_free_on_any_of_their_cards() -> None:
    """kube-scheduler prints each distinct reason once with its count of nodes: a free figure per
    node made one line per node (issue 37); the figure is the most free on a card of any node."""
    st = _cluster([9500, 9000, 8000, 8000], keep=3)
    result = st.filter(_pod(3000), ["n0", "n1", "n2", "n3"])
    assert result.nodes == []
    reasons = set(result.failed.values())
    assert len(reasons) == 1, reasons
    assert "1 card(s) insufficient memory (the most free: 2000 MiB)" in reasons.pop()


def test_prioritize_on_the_kept_nodes_gives_the_fullest_the_top_score() -> None:
    st = _cluster([0, 5000, 9500, 7000, 2000, 6000], keep=3)
    kept = st.filter(_pod(1000), [f"n{i}" for i in range(6)]).nodes
    scores = st.prioritize(_pod(1000), kept)
    assert scores["n3"] == 10 and scores["n1"] == 0 and 0 < scores["n5"] < 10


def test_a_pod_of_several_vgpu_containers_is_also_cut_to_the_best_nodes() -> None:
    st = _cluster([0, 5000, 8000, 7000, 2000], keep=2)
    result = st.filter(_pod(1000, containers=2), [f"n{i}" for i in range(5)])
    # two more vGPUs of 1000 MiB: n2 (8000) and n3 (7000) still take them and are the fullest
    assert result.nodes == ["n2", "n3"]


def test_a_filter_keep_below_one_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="filter_keep"):
        SchedulerState(CFG, filter_keep=0)


@settings(max_examples=150, deadline=None)
@given(
    loads=hst.lists(hst.integers(0, 10000), min_size=1, max_size=30),
    mem=hst.integers(1, 10000),
    keep=hst.integers(1, 8),
    spread=hst.booleans(),
)
def test_filter_offers_a_node_whenever_one_fits_and_never_a_worse_one_than_it_drops(
    loads: list[int], mem: int, keep: int, spread: bool
) -> None:
    names = [f"n{i}" for i in range(len(loads))]
    policy = "spread" if spread else "binpack"
    everything = _cluster(loads, keep=len(loads)).filter(_pod(mem, policy=policy), names)
    result = _cluster(loads, keep=keep).filter(_pod(mem, policy=policy), names)
    fits = [n for n, load in zip(names, loads, strict=True) if load + mem <= 10000]
    assert everything.nodes == fits
    assert bool(result.nodes) == bool(fits)
    assert len(result.nodes) == min(keep, len(fits)) and set(result.nodes) <= set(fits)
    load = dict(zip(names, loads, strict=True))
    dropped = set(fits) - set(result.nodes)
    for kept in result.nodes:
        for other in dropped:
            assert (load[kept] <= load[other]) if spread else (load[kept] >= load[other])


def test_filter_keep_comes_from_the_flag_then_the_environment_then_the_default() -> None:
    from vgpu.extender.cli import filter_keep_setting
    from vgpu.extender.state import FILTER_KEEP

    assert filter_keep_setting(5, {"VGPU_FILTER_KEEP": "3"}) == 5
    assert filter_keep_setting(None, {"VGPU_FILTER_KEEP": "3"}) == 3
    assert filter_keep_setting(None, {}) == FILTER_KEEP == 1


@pytest.mark.parametrize(
    ("flag", "env", "named"),
    [(0, {}, "--filter-keep"), (None, {"VGPU_FILTER_KEEP": "many"}, "VGPU_FILTER_KEEP")],
)
def test_a_bad_filter_keep_is_refused_naming_where_it_came_from(
    flag: int | None, env: dict[str, str], named: str
) -> None:
    from vgpu.core.errors import ConfigError
    from vgpu.extender.cli import filter_keep_setting

    with pytest.raises(ConfigError, match=named) as info:
        filter_keep_setting(flag, env)
    assert "at least 1" in str(info.value)


def test_the_extender_worker_hands_the_gil_over_ten_times_as_often_as_cpython() -> None:
    import sys

    from vgpu.extender.server import tune_gil

    before = sys.getswitchinterval()
    try:
        tune_gil()
        assert sys.getswitchinterval() == pytest.approx(0.0005) and before == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(before)


# -- filter's answer holds the pod's capacity until bind (as kube-scheduler assumes a pod) ----------


def _assuming(loads: list[int], fail: bool = False) -> tuple[SchedulerState, list[float]]:
    st = _cluster(loads, keep=1)
    now = [NOW]
    st.clock = lambda: now[0]
    st.kube = FakeKube(fail_bind=fail)  # what the state needs of the API server (``KubeAPI``)
    return st, now


def _held(st: SchedulerState, node: str) -> int:
    return sum(u.memory_mib for u in st.ledger.usage(node).values())


def test_the_next_pod_filtered_before_the_first_is_bound_is_not_offered_the_room_it_takes() -> None:
    st, _ = _assuming([9000, 0])  # n0 has room for one pod of 1000 MiB
    assert st.filter(_pod(1000, uid="p1"), ["n0", "n1"]).nodes == ["n0"]
    # p1's bind has not come yet (kube-scheduler binds asynchronously): p2 must not get n0 too
    assert st.filter(_pod(1000, uid="p2"), ["n0", "n1"]).nodes == ["n1"]
    assert st.bind("d", "p1", "p1", "n0") == ("", "ok")
    assert st.bind("d", "p2", "p2", "n1") == ("", "ok")  # no conflict, so no back-off for p2
    assert (_held(st, "n0"), _held(st, "n1")) == (10000, 1000)
    assert st.assumed == {}


def test_a_pod_filtered_again_is_held_once_not_twice() -> None:
    st, _ = _assuming([9000, 0])
    for _ in range(3):
        assert st.filter(_pod(1000, uid="p1"), ["n0", "n1"]).nodes == ["n0"]
    assert _held(st, "n0") == 10000
    assert list(st.assumed) == ["p1"]


def test_a_pod_never_bound_frees_the_room_after_the_assume_ttl() -> None:
    st, now = _assuming([9000, 0])
    st.filter(_pod(1000, uid="p1"), ["n0", "n1"])
    now[0] += ASSUME_TTL_S - 1
    for i in range(2):  # the plugins keep renewing their Leases meanwhile
        st.apply_lease(lease(f"vgpu-n{i}", now[0]))
    assert st.filter(_pod(1000, uid="p2"), ["n0", "n1"]).nodes == ["n1"]  # still held
    now[0] += 2
    assert st.filter(_pod(1000, uid="p3"), ["n0", "n1"]).nodes == ["n0"]  # p1's hold lapsed
    assert st.ledger.node_of("p1") is None


def test_a_pod_deleted_between_filter_and_bind_frees_the_room() -> None:
    st, _ = _assuming([9000, 0])
    st.filter(_pod(1000, uid="p1"), ["n0", "n1"])
    st.apply_pod(_pod(1000, uid="p1"), deleted=True)
    assert st.filter(_pod(1000, uid="p2"), ["n0", "n1"]).nodes == ["n0"]


def test_a_bind_that_finds_no_room_frees_what_filter_held() -> None:
    st, _ = _assuming([9000, 0])
    st.filter(_pod(1000, uid="p1"), ["n0", "n1"])
    # meanwhile the watch shows another pod holding n0's last room (reality wins over the hold)
    st.apply_pod(alloc_pod("other", 5, node="n0", mem=1000) | {"status": {"phase": "Running"}})
    st.ledger.commit("other", "n0", {"GPU-n0": Usage(1000, 0, 1, 0)})
    error, kind = st.bind("d", "p1", "p1", "n0")
    assert kind == "conflict" and "no room" in error
    assert st.ledger.node_of("p1") is None and st.assumed == {}
    assert _held(st, "n0") == 10000  # the 9000 held before and the other pod's 1000


def test_a_bind_the_api_server_refuses_frees_what_filter_held() -> None:
    st, _ = _assuming([9000, 0], fail=True)
    st.filter(_pod(1000, uid="p1"), ["n0", "n1"])
    error, kind = st.bind("d", "p1", "p1", "n0")
    assert kind == "error" and "said no" in error
    assert st.ledger.node_of("p1") is None and st.assumed == {}
    assert _held(st, "n0") == 9000


def test_with_several_nodes_answered_nothing_is_held() -> None:
    st = _cluster([9000, 0, 0], keep=2)
    assert st.filter(_pod(1000, uid="p1"), ["n0", "n1", "n2"]).nodes == ["n0", "n1"]
    assert st.assumed == {} and st.ledger.node_of("p1") is None


def test_pods_refused_for_lack_of_room_just_before_it_frees_are_nudged_once() -> None:
    """kube-scheduler may retry a refused pod on the very deletion that frees the room, before our
    watch delivered it; those pods are handed to the Syncer to annotate, so they are retried."""
    st, now = _assuming([9000])  # n0: one card, 1000 MiB free
    assert st.filter(_pod(5000, uid="early"), ["n0"]).failed
    now[0] += NUDGE_WINDOW_S + 1
    assert st.filter(_pod(5000, uid="late"), ["n0"]).failed
    assert st.filter(_pod(5000, uid="gone"), ["n0"]).failed
    st.apply_pod({"metadata": {"uid": "gone"}}, deleted=True)  # never there: frees nothing
    huge = st.filter(_pod(50000, uid="huge"), ["n0"])
    assert huge.unresolvable and not huge.failed  # smaller than asked: waiting does not help
    assert st.filter(_pod(500, uid="fits"), ["n0"]).nodes == ["n0"]
    assert not st.room_freed.is_set()
    now[0] += 0.05
    st.apply_pod({"metadata": {"uid": "held-0"}}, deleted=True)  # the pod holding n0 leaves
    assert st.room_freed.is_set()
    assert st.take_nudges() == [("late", "d", "late")]
    assert st.take_nudges() == []  # once: a new refusal notes it again
    assert st.filter(_pod(9900, uid="late"), ["n0"]).failed  # n0 still holds "fits"
    st.apply_pod({"metadata": {"uid": "fits"}}, deleted=True)
    assert st.take_nudges() == [("late", "d", "late")]
