"""filter visits nodes in policy order and stops at filter_keep: the same answer as fitting every node.

Random clusters (mixed card sizes, splits, health, committed usage, missing or expired plugin
Leases, nodes without inventory), random one-container pods and node policies: the indexed filter
and the full scan (``SchedulerState.indexed = False``) must answer the same nodes, and, when fewer
nodes fit than filter keeps, the same reasons. Pods then come and go and inventories change on
the same state, so the node groups and cached summaries are checked after such changes too.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vgpu.core import annotations as ann
from vgpu.core.capacity import card_summary, may_fit, quick_fits
from vgpu.core.config import SchedulerConfig
from vgpu.core.ledger import Usage, vgpu_usage
from vgpu.core.requests import ContainerRequest
from vgpu.core.selection import Selection
from vgpu.extender.state import SchedulerState

NOW = 2_000_000.0
MODELS = ("NVIDIA H200", "Tesla T4")


def _lease(node: str, renewed: float) -> dict[str, Any]:
    t = dt.datetime.fromtimestamp(renewed, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {"metadata": {"name": f"vgpu-{node}"}, "spec": {"renewTime": t, "leaseDurationSeconds": 10}}


@st.composite
def devices(draw: st.DrawFn, node: str) -> tuple[ann.Device, ...]:
    return tuple(
        ann.Device(
            uuid=f"{node}-GPU-{k}",
            index=k,
            model=draw(st.sampled_from(MODELS)),
            memory_mib=draw(st.sampled_from([1000, 2000, 4000])),
            cores=draw(st.sampled_from([100, 200])),
            split=draw(st.integers(1, 4)),
            healthy=draw(st.integers(0, 5)) > 0,
        )
        for k in range(draw(st.integers(1, 4)))
    )


@st.composite
def clusters(draw: st.DrawFn) -> tuple[SchedulerState, list[str], list[ann.NodeInventory | None]]:
    node_policy = draw(st.sampled_from(["binpack", "spread"]))
    st_ = SchedulerState(
        SchedulerConfig(node_policy=node_policy),
        clock=lambda: NOW,
        filter_keep=draw(st.integers(1, 4)),
    )
    names, invs = [], []
    for i in range(draw(st.integers(1, 10))):
        name = f"n{i}"
        names.append(name)
        kind = draw(st.integers(0, 9))
        if kind == 0:  # no inventory at all
            st_.apply_node({"metadata": {"name": name}})
            invs.append(None)
            continue
        inv = ann.NodeInventory(draw(devices(name)))
        invs.append(inv)
        st_.apply_node(
            {"metadata": {"name": name, "annotations": {ann.DEVICES_ANNOTATION: ann.encode_devices(inv)}}}
        )
        if kind != 1:  # kind 1: the plugin's Lease is missing
            st_.apply_lease(_lease(name, NOW - (60 if kind == 2 else 1)))  # kind 2: expired
        for j, d in enumerate(inv.devices):
            for k in range(draw(st.integers(0, 2))):
                mem = draw(st.integers(0, d.memory_mib // 2))
                st_.ledger.commit(
                    f"held-{name}-{j}-{k}",
                    name,
                    {d.uuid: vgpu_usage(mem, draw(st.sampled_from([0, 30, 100])))},
                )
    st_.synced.set()
    st_.leader.set()
    asked = draw(st.permutations(names))
    asked = asked[: draw(st.integers(1, len(asked)))]
    if draw(st.booleans()):
        asked = [*asked, "ghost"]  # a node the extender has not seen
    return st_, asked, invs


@st.composite
def one_container_pods(draw: st.DrawFn, uid: str) -> dict[str, Any]:
    limits: dict[str, str] = {"nvidia.com/gpu": str(draw(st.integers(1, 3)))}
    if draw(st.booleans()):
        limits["nvidia.com/gpumem"] = str(draw(st.sampled_from([100, 500, 1000, 1500, 3000])))
    else:
        limits["nvidia.com/gpumem-percentage"] = str(draw(st.sampled_from([10, 50, 100])))
    limits["nvidia.com/gpucores"] = str(draw(st.sampled_from([0, 20, 50, 100])))
    annotations = {}
    policy = draw(st.sampled_from([None, "binpack", "spread"]))
    if policy:
        annotations[ann.NODE_POLICY_ANNOTATION] = policy
    selection = draw(
        st.sampled_from(
            [None, (ann.USE_GPUTYPE_ANNOTATION, "t4"), (ann.NOUSE_GPUUUID_ANNOTATION, "n0-GPU-0")]
        )
    )
    if selection:
        annotations[selection[0]] = selection[1]
    return {
        "metadata": {"uid": uid, "name": uid, "namespace": "d", "annotations": annotations},
        "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]},
    }


def _same(st_: SchedulerState, pod: dict[str, Any], asked: list[str]) -> list[str]:
    st_.indexed = False
    full = st_.filter(pod, asked)
    st_.indexed = True
    fast = st_.filter(pod, asked)
    assert fast.nodes == full.nodes, (fast, full)
    if len(full.nodes) < st_.filter_keep:
        assert (fast.failed, fast.unresolvable) == (full.failed, full.unresolvable)
    return fast.nodes


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(), st.data())
def test_filter_in_policy_order_answers_exactly_what_fitting_every_node_answers(
    cluster: tuple[SchedulerState, list[str], list[ann.NodeInventory | None]], data: st.DataObject
) -> None:
    st_, asked, _ = cluster
    for step in range(data.draw(st.integers(1, 4))):
        pod = data.draw(one_container_pods(f"p{step}"))
        nodes = _same(st_, pod, asked)
        # the pod binds to one of them (or an earlier pod goes away): the ledger moves on
        if nodes and data.draw(st.booleans()):
            assert st_.kube is None
            inv = st_.nodes[nodes[0]].inventory
            assert inv is not None
            card = data.draw(st.sampled_from(inv.devices))
            st_.ledger.commit(f"p{step}", nodes[0], {card.uuid: vgpu_usage(1, 0)})
            # the same pod filtered again while it holds capacity: the full scan answers
            _same(st_, pod, asked)
        elif st_.ledger.pods() and data.draw(st.booleans()):
            st_.ledger.release(data.draw(st.sampled_from(sorted(st_.ledger.pods()))))
        if data.draw(st.integers(0, 3)) == 0:  # a device plugin reports new cards, or none
            name = data.draw(st.sampled_from(sorted(st_.nodes)))
            annotations = {}
            if data.draw(st.booleans()):
                inv = ann.NodeInventory(data.draw(devices(name)))
                annotations[ann.DEVICES_ANNOTATION] = ann.encode_devices(inv)
            st_.apply_node({"metadata": {"name": name, "annotations": annotations}})


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_card_summary_never_turns_away_a_node_that_fits(data: st.DataObject) -> None:
    inv = ann.NodeInventory(data.draw(devices("n")))
    usage = {
        d.uuid: Usage(
            data.draw(st.integers(0, d.memory_mib)),
            data.draw(st.sampled_from([0, 30, 100])),
            data.draw(st.integers(0, 4)),
            data.draw(st.integers(0, 1)),
        )
        for d in inv.devices
        if data.draw(st.booleans())
    }
    percent = data.draw(st.booleans())
    c = ContainerRequest(
        "main",
        data.draw(st.integers(1, 3)),
        None if percent else data.draw(st.sampled_from([100, 1000, 3000])),
        data.draw(st.sampled_from([10, 100])) if percent else None,
        data.draw(st.sampled_from([0, 20, 100])),
    )
    selection = data.draw(st.sampled_from([Selection(), Selection(use_types=("t4",))]))
    if quick_fits(inv, usage, c, selection):
        assert may_fit(card_summary(inv, usage), c)


def test_the_pods_own_share_decides_between_nodes_of_different_sizes() -> None:
    # now, n0 (two 4000 MiB cards, one vGPU held) is fuller than n1 (two empty 1000 MiB cards);
    # with the pod's two vGPUs of 1000 MiB on it, n1 is full and n0 not: binpack takes n1
    st_ = SchedulerState(SchedulerConfig(), clock=lambda: NOW)
    shapes = {"n0": (4000, 4), "n1": (1000, 1)}
    for name, (mem, split) in shapes.items():
        inv = ann.NodeInventory(
            tuple(ann.Device(f"{name}-GPU-{k}", k, "m", mem, 100, split) for k in range(2))
        )
        st_.apply_node(
            {"metadata": {"name": name, "annotations": {ann.DEVICES_ANNOTATION: ann.encode_devices(inv)}}}
        )
        st_.apply_lease(_lease(name, NOW))
    st_.ledger.commit("held", "n0", {"n0-GPU-0": vgpu_usage(1000, 0)})
    st_.synced.set()
    st_.leader.set()
    pod = {
        "metadata": {"uid": "p", "name": "p", "namespace": "d"},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "resources": {"limits": {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "1000"}},
                }
            ]
        },
    }
    assert _same(st_, pod, ["n0", "n1"]) == ["n1"]
