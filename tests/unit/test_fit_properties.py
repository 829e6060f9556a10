"""Properties of the fit over random clusters and request sequences (hypothesis).

The oracle below is an independent brute force: it tries every assignment of every vGPU to a card
and checks the per-card limits directly, so it shares no search code with :mod:`vgpu.core.fit`.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vgpu.core.annotations import Device, NodeInventory
from vgpu.core.capacity import quick_fits
from vgpu.core.fit import Plan, fit_node
from vgpu.core.ledger import ZERO, Ledger, Usage, vgpu_usage
from vgpu.core.requests import ContainerRequest, PodRequest
from vgpu.core.selection import Selection

MODELS = ("NVIDIA H200", "Tesla T4")


@st.composite
def inventories(draw: st.DrawFn, prefix: str = "n") -> NodeInventory:
    n = draw(st.integers(1, 4))
    devices = []
    for i in range(n):
        devices.append(
            Device(
                uuid=f"{prefix}-GPU-{i}",
                index=i,
                model=draw(st.sampled_from(MODELS)),
                memory_mib=draw(st.sampled_from([1000, 2000, 4000])),
                cores=draw(st.sampled_from([100, 200])),
                split=draw(st.integers(1, 4)),
                numa=draw(st.integers(0, 1)),
                healthy=draw(st.booleans().map(lambda b: b or draw(st.booleans()))),
                sharing=draw(st.sampled_from(["timeslice", "timeslice", "mps"])),
            )
        )
    return NodeInventory(devices=tuple(devices))


@st.composite
def containers(draw: st.DrawFn, name: str, init: bool) -> ContainerRequest:
    percent = draw(st.booleans())
    return ContainerRequest(
        name=name,
        count=draw(st.integers(0 if init else 1, 2)),
        memory_mib=None if percent else draw(st.sampled_from([100, 500, 1000, 1500, 3000])),
        memory_percent=draw(st.sampled_from([10, 50, 100])) if percent else None,
        cores=draw(st.sampled_from([0, 0, 20, 50, 100])),
        init=init,
        sidecar=init and draw(st.booleans()),
    )


@st.composite
def pods(draw: st.DrawFn) -> PodRequest:
    inits = [draw(containers(f"i{k}", True)) for k in range(draw(st.integers(0, 2)))]
    apps = [draw(containers(f"a{k}", False)) for k in range(draw(st.integers(1, 2)))]
    selection = draw(
        st.sampled_from(
            [
                Selection(),
                Selection(use_types=("t4",)),
                Selection(nouse_uuids=("n-GPU-0",)),
                Selection(kinds=frozenset({"mps"})),
                Selection(kinds=frozenset({"mps", "hami-core"})),
            ]
        )
    )
    return PodRequest(
        tuple(inits + apps), selection, gpu_policy=draw(st.sampled_from([None, "binpack", "spread"]))
    )


def oracle_fits(inv: NodeInventory, usage: Mapping[str, Usage], pod: PodRequest) -> bool:
    """Brute force: does any assignment of vGPUs to cards respect every card's limits?"""
    wanted = [c for c in pod.containers if c.count > 0]
    choices = [
        list(
            itertools.permutations(
                [d for d in inv.devices if d.healthy and pod.selection.why_not_card(d, c.count) is None],
                c.count,
            )
        )
        for c in wanted
    ]
    phases = [[c.name for c in phase] for phase in pod.phases()]
    for assignment in itertools.product(*choices):
        placed = {c.name: (c, combo) for c, combo in zip(wanted, assignment, strict=True)}
        fp: dict[str, Usage] = {}
        ok = True
        for phase in phases:
            use: dict[str, Usage] = {}
            for name in phase:
                c, combo = placed[name]
                for d in combo:
                    use[d.uuid] = use.get(d.uuid, ZERO) + vgpu_usage(c.memory_on(d.memory_mib), c.cores)
            for uuid, u in use.items():
                if u.exclusive and u.count > 1:
                    ok = False
                fp[uuid] = fp.get(uuid, ZERO).max(u)
        for d in inv.devices:
            mine, other = fp.get(d.uuid, ZERO), usage.get(d.uuid, ZERO)
            total = mine + other
            if mine.count and (other.exclusive or (mine.exclusive and other.count)):
                ok = False
            if total.memory_mib > d.memory_mib or total.cores > d.cores or total.count > d.split:
                ok = False
        if ok:
            return True
    return False


def within_capacity(inv: NodeInventory, usage: Mapping[str, Usage]) -> bool:
    for d in inv.devices:
        u = usage.get(d.uuid, ZERO)
        if u.memory_mib > d.memory_mib or u.cores > d.cores or u.count > d.split:
            return False
    return True


def exclusive_alone(footprints: list[Mapping[str, Usage]]) -> bool:
    """A card holding one pod's exclusive vGPU holds no other pod's vGPU."""
    for i, fp in enumerate(footprints):
        for uuid, u in fp.items():
            if u.exclusive and any(o.get(uuid, ZERO).count for j, o in enumerate(footprints) if j != i):
                return False
    return True


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inventories(), pods(), st.data())
def test_a_pod_that_fits_a_node_is_never_rejected_and_one_that_does_not_is_never_placed(
    inv: NodeInventory, pod: PodRequest, data: st.DataObject
) -> None:
    # some capacity already committed by other pods, itself within the cards
    usage: dict[str, Usage] = {}
    for d in inv.devices:
        if data.draw(st.booleans()):
            u = vgpu_usage(data.draw(st.integers(0, d.memory_mib)), data.draw(st.sampled_from([0, 30, 100])))
            usage[d.uuid] = u
    result = fit_node("n", inv, usage, pod)
    assert isinstance(result, Plan) == oracle_fits(inv, usage, pod), result


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(inventories(), min_size=1, max_size=3), st.lists(st.tuples(pods(), st.booleans()), max_size=12)
)
def test_committed_memory_cores_and_vgpus_never_exceed_any_card(
    nodes: list[NodeInventory], requests: list[tuple[PodRequest, bool]]
) -> None:
    # give every node distinct card uuids
    cluster = {
        f"node-{k}": NodeInventory(
            tuple(Device(**{**d.__dict__, "uuid": f"node-{k}-{d.uuid}"}) for d in inv.devices)
        )
        for k, inv in enumerate(nodes)
    }
    ledger = Ledger()
    live: list[str] = []
    footprints: dict[str, Mapping[str, Usage]] = {}
    for n, (pod, release_one) in enumerate(requests):
        placed = False
        for name, inv in cluster.items():
            usage = ledger.usage(name)
            result = fit_node(name, inv, usage, pod)
            if isinstance(result, Plan):
                ledger.commit(f"pod-{n}", name, result.footprint)
                live.append(f"pod-{n}")
                footprints[f"pod-{n}"] = result.footprint
                placed = True
                break
            # a rejection means the brute force finds no way either
            assert not oracle_fits(inv, usage, pod)
        if release_one and live and not placed:
            footprints.pop(live[0])
            ledger.release(live.pop(0))
        for name, inv in cluster.items():
            assert within_capacity(inv, ledger.usage(name)), (name, ledger.usage(name))
        assert exclusive_alone(list(footprints.values()))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inventories(), containers("main", False), st.data())
def test_the_fast_path_for_one_container_chooses_exactly_what_the_general_search_chooses(
    inv: NodeInventory, c: ContainerRequest, data: st.DataObject
) -> None:
    pod = PodRequest((ContainerRequest(c.name, c.count, c.memory_mib, c.memory_percent, c.cores),))
    usage = {
        d.uuid: vgpu_usage(data.draw(st.integers(0, d.memory_mib)), data.draw(st.sampled_from([0, 30, 100])))
        for d in inv.devices
        if data.draw(st.booleans())
    }
    policy = data.draw(st.sampled_from(["binpack", "spread"]))
    fast = fit_node("n", inv, usage, pod, policy)
    general = fit_node("n", inv, usage, pod, policy, fast=False)
    assert type(fast) is type(general)
    if isinstance(fast, Plan) and isinstance(general, Plan):
        assert fast.allocation == general.allocation and fast.footprint == general.footprint
    # filter and prioritize ask without deciding: same answer, and a plan that is itself valid
    quick = fit_node("n", inv, usage, pod, policy, decide=False)
    assert isinstance(quick, Plan) == isinstance(general, Plan)
    assert quick_fits(inv, usage, pod.containers[0], pod.selection) == isinstance(general, Plan)
    if isinstance(quick, Plan):
        for d in inv.devices:
            u = usage.get(d.uuid, ZERO) + quick.footprint.get(d.uuid, ZERO)
            assert u.memory_mib <= d.memory_mib and u.cores <= d.cores and u.count <= d.split
