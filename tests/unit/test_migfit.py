"""MIG on demand in the extender's fit: the smallest profile, placements that keep large profiles
possible, bookings in the ledger that never overlap, and reasons for what cannot fit."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.test_fit import ctr, pod
from vgpu.core.annotations import (
    ALLOCATION_ANNOTATION,
    Allocation,
    ContainerAllocation,
    Device,
    DeviceAllocation,
    MigDynamic,
    MigGrant,
    MigInstance,
    NodeInventory,
    decode_allocation,
    decode_devices,
    encode_allocation,
    encode_devices,
)
from vgpu.core.errors import AnnotationError
from vgpu.core.fit import Plan, Rejection, fit_node
from vgpu.core.ledger import BOOKED, Ledger, footprint, mig_key, parse_mig_key
from vgpu.core.mig import H100_80GB, Placement, free_placements
from vgpu.core.migfit import profile_for

H100 = "NVIDIA H100 80GB HBM3"


def mig_card(i: int, *instances: tuple[str, int, str]) -> Device:
    held = tuple(
        MigInstance(name, start, H100_80GB.profile(name).memory_slices, owner)
        for name, start, owner in instances
    )
    return Device(f"GPU-{i}", i, H100, 81559, 100, 7, mig_dynamic=MigDynamic("H100 80GB", held))


def grants(result: Plan | Rejection, container: str = "main") -> list[tuple[str, str, int]]:
    assert isinstance(result, Plan), result
    c = result.allocation.container(container)
    assert c is not None
    out = []
    for d in c.devices:
        assert d.mig is not None
        out.append((d.uuid, d.mig.profile, d.mig.start))
    return out


def test_the_smallest_profile_that_holds_memory_and_compute() -> None:
    def smallest(**limits: Any) -> str | None:
        (c,) = pod(ctr(**limits)).containers
        p = profile_for(H100_80GB, c)
        return p.name if p else None

    assert smallest(gpumem=5000) == "1g.10gb"
    assert smallest(gpumem=9984) == "1g.10gb"
    assert smallest(gpumem=9985) == "1g.20gb"  # two memory slices, one compute slice
    assert smallest(gpumem=5000, gpucores=20) == "2g.20gb"  # 20 percent of the SMs: two slices
    assert smallest(gpumem=30000) == "3g.40gb"
    assert smallest(gpumem=30000, gpucores=50) == "4g.40gb"
    assert smallest(gpumem=50000) == "7g.80gb"
    assert smallest(gpumem_percentage=50) == "3g.40gb"  # four of the eight memory slices
    assert smallest(gpucores=100) == "7g.80gb"  # an exclusive vGPU: the whole card
    assert smallest(gpumem=90000) is None


def test_a_small_instance_goes_where_it_keeps_the_large_profiles_possible() -> None:
    # an empty card: the 1g goes to the last slice, leaving 4g (0-3) and a 3g (4-7)... possible
    (g,) = grants(fit_node("n", NodeInventory((mig_card(0),)), {}, pod(ctr(gpumem=5000))))
    assert g[1:] == ("1g.10gb", 6)
    held = [("1g.10gb", Placement(6, 1))]
    assert free_placements(H100_80GB, "4g.40gb", held) and free_placements(H100_80GB, "3g.40gb", held)
    # a card already cut takes it rather than the empty one, which stays whole for a 7g
    inv = NodeInventory((mig_card(0), mig_card(1, ("3g.40gb", 0, "pod-a"))))
    (g,) = grants(fit_node("n", inv, {}, pod(ctr(gpumem=5000))))
    assert g[0] == "GPU-1" and g[1] == "1g.10gb"
    big = grants(fit_node("n", inv, {}, pod(ctr(gpumem=70000))))
    assert big == [("GPU-0", "7g.80gb", 0)]


def test_bookings_in_the_ledger_never_overlap_and_fill_a_card_to_seven() -> None:
    inv = NodeInventory((mig_card(0),))
    ledger = Ledger()
    taken: list[Placement] = []
    for n in range(7):
        result = fit_node("n", inv, ledger.usage("n"), pod(ctr(gpumem=5000)))
        ((uuid, profile, start),) = grants(result)
        place = Placement(start, 1)
        assert not any(place.overlaps(t) for t in taken), (place, taken)
        taken.append(place)
        assert isinstance(result, Plan)
        ledger.commit(f"pod-{n}", "n", result.footprint)
        assert result.footprint[mig_key(uuid, MigGrant(profile, start))] == BOOKED
    last = fit_node("n", inv, ledger.usage("n"), pod(ctr(gpumem=5000)))
    assert isinstance(last, Rejection) and not last.unresolvable
    assert "no free 1g.10gb placement" in last.reason and "%" not in last.reason
    # one pod leaves: its placement, and only its, is free again
    ledger.release("pod-3")
    (again,) = grants(fit_node("n", inv, ledger.usage("n"), pod(ctr(gpumem=5000))))
    assert again[2] == taken[3].start


def test_an_instance_the_node_reports_is_taken_even_when_no_booking_names_it() -> None:
    # a leftover the node has not reclaimed yet (no pod), and one of a pod the ledger forgot
    inv = NodeInventory((mig_card(0, ("4g.40gb", 0, ""), ("3g.40gb", 4, "pod-x")),))
    result = fit_node("n", inv, {}, pod(ctr(gpumem=5000)))
    assert isinstance(result, Rejection) and "no free 1g.10gb placement" in result.reason


def test_a_pod_of_several_containers_and_vgpus_gets_distinct_cards_and_placements() -> None:
    inv = NodeInventory((mig_card(0), mig_card(1)))
    p = pod(ctr("a", gpu=2, gpumem=15000), ctr("b", gpumem=30000), init=(ctr("i", gpumem=5000),))
    result = fit_node("n", inv, {}, p)
    a, b, i = grants(result, "a"), grants(result, "b"), grants(result, "i")
    assert {g[0] for g in a} == {"GPU-0", "GPU-1"} and {g[1] for g in a} == {"1g.20gb"}
    per_card: dict[str, list[Placement]] = {}
    for uuid, profile, start in a + b + i:
        place = Placement(start, H100_80GB.profile(profile).memory_slices)
        assert not any(place.overlaps(o) for o in per_card.get(uuid, [])), (uuid, place)
        per_card.setdefault(uuid, []).append(place)


def test_a_request_no_profile_holds_is_unresolvable_with_the_largest_named() -> None:
    result = fit_node("n", NodeInventory((mig_card(0),)), {}, pod(ctr(gpumem=90000)))
    assert isinstance(result, Rejection) and result.unresolvable
    assert "no MIG profile that large (the largest, 7g.80gb, has 81152 MiB)" in result.reason
    two = fit_node("n", NodeInventory((mig_card(0),)), {}, pod(ctr(gpu=2, gpumem=5000)))
    assert isinstance(two, Rejection) and two.unresolvable and "1 MIG card(s) fit" in two.reason


def test_the_extender_books_the_placements_again_from_the_allocation_after_a_restart() -> None:
    inv = NodeInventory((mig_card(0),))
    result = fit_node("n", inv, {}, pod(ctr(gpumem=30000)))
    assert isinstance(result, Plan)
    text = encode_allocation(result.allocation)
    assert '"mig":{"profile":"3g.40gb","start":4}' in text
    again = decode_allocation(text)
    assert again == result.allocation
    fresh = Ledger()  # a restarted extender: the ledger rebuilt from the pods' annotations
    fresh.commit("pod-a", "n", footprint(again))
    (key,) = [k for k in fresh.usage("n") if parse_mig_key(k)]
    assert parse_mig_key(key) == ("GPU-0", "3g.40gb", 4)
    other = fit_node("n", inv, fresh.usage("n"), pod(ctr(gpumem=30000)))
    assert grants(other) == [("GPU-0", "3g.40gb", 0)]
    assert isinstance(fit_node("n", inv, fresh.usage("n"), pod(ctr(gpumem=50000))), Rejection)


def test_the_inventory_of_a_dynamic_card_round_trips_as_version_2() -> None:
    inv = NodeInventory((mig_card(0, ("1g.10gb", 6, "uid-1")), Device("GPU-9", 1, H100, 81559, 100, 4)))
    text = encode_devices(inv)
    assert text.startswith('{"devices"') and '"version":2' in text
    back = decode_devices(text)
    assert back == inv  # the dataclass keeps version 1: the text says 2 wherever a device needs it
    plain = encode_devices(NodeInventory((Device("GPU-9", 1, H100, 81559, 100, 4),)))
    assert '"version":1' in plain and "migDynamic" not in plain


def test_a_malformed_mig_field_names_the_field() -> None:
    bad = encode_allocation(parse_alloc()).replace('"start":4', '"start":-1')
    with pytest.raises(AnnotationError, match=r"containers\[0\]\.devices\[0\]\.mig\.start"):
        decode_allocation(bad)
    inv = encode_devices(NodeInventory((mig_card(0, ("1g.10gb", 6, "")),))).replace('"size":1', '"size":"x"')
    with pytest.raises(AnnotationError, match=r"devices\[0\]\.migDynamic\.instances\[0\]\.size"):
        decode_devices(inv)


def parse_alloc() -> Any:
    result = fit_node("n", NodeInventory((mig_card(0),)), {}, pod(ctr(gpumem=30000)))
    assert isinstance(result, Plan)
    return result.allocation


def test_the_fast_paths_leave_a_dynamic_node_to_the_fit() -> None:
    from vgpu.core.capacity import quick_fits

    (c,) = pod(ctr(gpumem=5000)).containers
    full = NodeInventory((mig_card(0, ("7g.80gb", 0, "pod-a")),))
    assert not quick_fits(full, {}, c, pod(ctr(gpumem=5000)).selection)


def test_a_restarted_extenders_state_books_the_placements_before_any_instance_exists() -> None:
    """Two pods bound, their instances not made yet (the node reports none): the state rebuilt from
    the pods' allocations alone keeps a third pod off their placements."""
    from tests.unit.test_extender_state import alloc_pod, state

    inv = NodeInventory((mig_card(0),))
    st = state()
    pods = []
    for n, (profile, start) in enumerate((("3g.40gb", 4), ("2g.20gb", 0))):
        grant = MigGrant(profile, start)
        doc = alloc_pod(f"u{n}", 5 + n)
        alloc = Allocation("a", (ContainerAllocation("main", (DeviceAllocation("GPU-0", 3000, 10, grant),)),))
        doc["metadata"]["annotations"][ALLOCATION_ANNOTATION] = encode_allocation(alloc)
        pods.append(doc)
    st.replace_pods(pods)
    usage = st.ledger.usage("a")
    assert usage[mig_key("GPU-0", MigGrant("3g.40gb", 4))] == BOOKED
    (g,) = grants(fit_node("a", inv, usage, pod(ctr(gpumem=15000))))
    assert g[1] == "1g.20gb" and g[2] == 2  # the one two-slice placement left
    assert isinstance(fit_node("a", inv, usage, pod(ctr(gpumem=30000))), Rejection)
    st.apply_pod(pods[0], deleted=True)  # a pod leaves: its placement is free again
    (g,) = grants(fit_node("a", inv, st.ledger.usage("a"), pod(ctr(gpumem=30000))))
    assert g[1:] == ("3g.40gb", 4)


def test_hamis_vgpu_mode_mig_takes_only_cards_cut_on_demand_and_hami_core_only_shared_ones() -> None:
    shared = Device("GPU-9", 1, H100, 81559, 100, 10)
    mig_pod = pod(ctr(gpumem=5000), nvidia_com__vgpu_mode="mig")
    core_pod = pod(ctr(gpumem=5000), nvidia_com__vgpu_mode="hami-core")
    either = pod(ctr(gpumem=5000), nvidia_com__vgpu_mode="hami-core,mig")
    assert grants(fit_node("n", NodeInventory((mig_card(0),)), {}, mig_pod))[0][1] == "1g.10gb"
    refused = fit_node("n", NodeInventory((shared,)), {}, mig_pod)
    assert isinstance(
        refused, Rejection
    ) and "time-sliced under the hook (hami-core), not one nvidia.com/vgpu-mode mig takes" in str(refused)
    refused = fit_node("n", NodeInventory((mig_card(0),)), {}, core_pod)
    assert isinstance(
        refused, Rejection
    ) and "cut into MIG instances on demand (mig), not one nvidia.com/vgpu-mode hami-core takes" in str(
        refused
    )
    assert isinstance(fit_node("n", NodeInventory((shared,)), {}, core_pod), Plan)
    assert isinstance(fit_node("n", NodeInventory((mig_card(0),)), {}, either), Plan)
    assert isinstance(fit_node("n", NodeInventory((shared,)), {}, either), Plan)


def test_the_node_refuses_an_instance_larger_than_the_request_or_one_off_its_placements() -> None:
    from dataclasses import replace

    from vgpu.core.placementcheck import placement_problems

    card, shared = mig_card(0), Device("GPU-9", 1, H100, 81559, 100, 10)
    cards = {card.uuid: card, shared.uuid: shared}
    request = pod(ctr(gpumem=5000, gpucores=10))
    plan = fit_node("n", NodeInventory((card,)), {}, request)
    assert isinstance(plan, Plan)
    assert placement_problems(request, plan.allocation, cards) == []  # what the fit made passes

    def forged(**change: Any) -> list[str]:
        (c,) = plan.allocation.containers
        (d,) = c.devices
        dev = replace(d, **change)
        return placement_problems(
            request, replace(plan.allocation, containers=(replace(c, devices=(dev,)),)), cards
        )

    [why] = forged(mig=MigGrant("7g.80gb", 0))  # the whole card's SMs for a 1g request
    assert "7g.80gb" in why and "smallest profile that holds what it asks for is 1g.10gb" in why
    [why] = forged(mig=MigGrant("1g.10gb", 7))
    assert "1g.10gb starts only at [0, 1, 2, 3, 4, 5, 6]" in why
    [why] = forged(mig=None)
    assert "with no instance" in why
    [why] = forged(uuid="GPU-9")
    assert "not cut on demand" in why
