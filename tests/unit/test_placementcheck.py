"""The node's check of a placement against the pod's own request (vgpu/core/placementcheck.py)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from tests.unit.test_fit_properties import inventories, pods
from vgpu.core.annotations import Allocation, ContainerAllocation, Device, DeviceAllocation
from vgpu.core.fit import Plan, fit_node
from vgpu.core.placementcheck import at_least_requested, placement_problems
from vgpu.core.requests import ContainerRequest, PodRequest
from vgpu.core.selection import Selection

CARDS = {
    "GPU-a": Device("GPU-a", 0, "NVIDIA H100", 81920, 100, 10),
    "GPU-b": Device("GPU-b", 1, "NVIDIA H100", 81920, 100, 10),
}


def one(name: str = "main", count: int = 1, mib: int | None = 1000, pct: int | None = None, cores: int = 30):
    return ContainerRequest(name, count, mib, pct, cores)


def alloc(*containers: tuple[str, list[tuple[str, int, int]]]) -> Allocation:
    return Allocation(
        "node-a",
        tuple(ContainerAllocation(n, tuple(DeviceAllocation(*d) for d in devs)) for n, devs in containers),
    )


def test_the_placement_the_scheduler_writes_has_no_problem() -> None:
    request = PodRequest((one(count=2),))
    assert (
        placement_problems(request, alloc(("main", [("GPU-a", 1000, 30), ("GPU-b", 1000, 30)])), CARDS) == []
    )


def test_a_grant_of_no_memory_and_no_cores_for_a_pod_asking_1000_mib_is_named_field_by_field() -> None:
    problems = placement_problems(PodRequest((one(),)), alloc(("main", [("GPU-a", 0, 0)])), CARDS)
    assert problems == [
        "vgpu.openaios.io/allocation: container main is given 0 MiB on card GPU-a but asks for 1000 MiB "
        "(nvidia.com/gpumem 1000)",
        "vgpu.openaios.io/allocation: container main is given 0 MiB on card GPU-a: "
        "a grant must hold at least 1 MiB",
        "vgpu.openaios.io/allocation: container main is given 0 % of card GPU-a but asks for 30 % "
        "(nvidia.com/gpucores)",
    ]


def test_a_whole_card_request_must_get_the_whole_card_as_the_inventory_gives_it() -> None:
    whole = PodRequest((one(mib=None, pct=100, cores=0),))
    assert placement_problems(whole, alloc(("main", [("GPU-a", 81920, 0)])), CARDS) == []
    (problem,) = placement_problems(whole, alloc(("main", [("GPU-a", 40960, 0)])), CARDS)
    assert "asks for 81920 MiB (nvidia.com/gpumem-percentage 100)" in problem


def test_more_vgpus_cards_elsewhere_and_a_card_twice_are_each_refused() -> None:
    request = PodRequest((one(),))
    (more,) = placement_problems(request, alloc(("main", [("GPU-a", 1000, 30), ("GPU-b", 1000, 30)])), CARDS)
    assert more.endswith("is given 2 vGPU(s) but asks for 1 (nvidia.com/gpu)")
    (elsewhere,) = placement_problems(request, alloc(("main", [("GPU-z", 1000, 30)])), CARDS)
    assert "card GPU-z, which is not a card of this node" in elsewhere
    twice = placement_problems(
        PodRequest((one(count=2),)), alloc(("main", [("GPU-a", 1000, 30), ("GPU-a", 1000, 30)])), CARDS
    )
    assert any("two vGPUs on one card" in p for p in twice)


def test_containers_the_spec_does_not_give_vgpus_get_none() -> None:
    request = PodRequest((one(), one("sidecar", count=0, mib=0, cores=0)))
    problems = placement_problems(
        request, alloc(("main", [("GPU-a", 1000, 30)]), ("sidecar", [("GPU-b", 1000, 0)])), CARDS
    )
    assert problems == ["vgpu.openaios.io/allocation: container sidecar asks for no vGPU but is given 1"]
    (ghost,) = placement_problems(request, alloc(("main", [("GPU-a", 1000, 30)]), ("ghost", [])), CARDS)
    assert ghost == "vgpu.openaios.io/allocation: container ghost is not a container of the pod"
    (missing,) = placement_problems(request, alloc(), CARDS)
    assert (
        missing
        == "vgpu.openaios.io/allocation: container main asks for 1 vGPU(s) (nvidia.com/gpu) but is given none"
    )


def test_more_than_the_card_has_is_refused_even_where_the_pod_asks_for_it() -> None:
    small = {"GPU-a": Device("GPU-a", 0, "T4", 500, 100, 10)}
    problems = placement_problems(PodRequest((one(),)), alloc(("main", [("GPU-a", 1000, 30)])), small)
    assert problems == [
        "vgpu.openaios.io/allocation: container main is given 1000 MiB on card GPU-a, "
        "more than the card has (500 MiB)"
    ]


def test_a_ledger_books_at_least_what_the_pod_asks_for_where_the_annotation_says_less() -> None:
    request = PodRequest((one(mib=4000, cores=50),))
    forged = alloc(("main", [("GPU-a", 0, 0), ("GPU-z", 5, 5)]))
    booked = at_least_requested(request, forged, CARDS)
    assert booked.containers[0].devices == (
        DeviceAllocation("GPU-a", 4000, 50),
        DeviceAllocation("GPU-z", 5, 5),
    )
    bigger = alloc(("main", [("GPU-a", 9000, 70)]))
    assert at_least_requested(request, bigger, CARDS) == bigger


MODE_CARDS = {
    "GPU-mps": Device("GPU-mps", 0, "NVIDIA H100", 81920, 100, 10, sharing="mps"),
    "GPU-ts": Device("GPU-ts", 1, "NVIDIA H100", 81920, 100, 10),
}
MPS = Selection(kinds=frozenset({"mps"}))


def test_a_forged_allocation_on_a_card_of_the_wrong_mode_is_refused_each_way() -> None:
    on_mps = alloc(("main", [("GPU-mps", 1000, 30)]))
    on_ts = alloc(("main", [("GPU-ts", 1000, 30)]))
    # a pod that did not ask mps (no annotation, or hami-core) is never an MPS client
    for unasked in (Selection(), Selection(kinds=frozenset({"hami-core"}))):
        (problem,) = placement_problems(PodRequest((one(),), unasked), on_mps, MODE_CARDS)
        assert problem.startswith(
            "vgpu.openaios.io/allocation: container main is given card GPU-mps, shared "
        )
        assert "nvidia.com/vgpu-mode" in problem
    # a pod that asked only mps never runs time-sliced
    (problem,) = placement_problems(PodRequest((one(),), MPS), on_ts, MODE_CARDS)
    assert "GPU-ts, time-sliced under the hook (hami-core), not one nvidia.com/vgpu-mode mps takes" in problem


def test_honest_allocations_on_either_mode_pass_and_an_mps_card_holds_a_container_of_one() -> None:
    on_mps = alloc(("main", [("GPU-mps", 1000, 30)]))
    assert placement_problems(PodRequest((one(),), MPS), on_mps, MODE_CARDS) == []
    assert placement_problems(PodRequest((one(),)), alloc(("main", [("GPU-ts", 1000, 30)])), MODE_CARDS) == []
    both = Selection(kinds=frozenset({"mps", "hami-core"}))
    assert placement_problems(PodRequest((one(),), both), on_mps, MODE_CARDS) == []
    two = alloc(("main", [("GPU-mps", 1000, 30), ("GPU-ts", 1000, 30)]))
    (problem,) = placement_problems(PodRequest((one(count=2),), both), two, MODE_CARDS)
    assert "MPS card GPU-mps among 2" in problem


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inventories(), pods())
def test_every_placement_the_fit_makes_passes_the_nodes_check(inv, pod) -> None:  # type: ignore[no-untyped-def]
    """The node re-derives what the extender's own fit gave: the two must never disagree."""
    result = fit_node("n", inv, {}, pod)
    if not isinstance(result, Plan):
        return
    cards = {d.uuid: d for d in inv.devices}
    allocation = result.allocation
    assert placement_problems(pod, allocation, cards) == []
    assert at_least_requested(pod, allocation, cards) == allocation
