"""MIG cards as partitionable devices (vgpu/dra/migslices.py): every H100 profile and placement
a device consuming exactly its slices, so that the scheduler's counting allows a set of devices
exactly when the card's placement rules (vgpu/core/mig.py) do; the pool shaped to the 1.36 API's
limits."""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

from vgpu.core.mig import H100_80GB, H200_141GB, MigTable, Placement, free_placements
from vgpu.dra.migslices import (
    COMPUTE_COUNTER,
    MEDIA_COUNTER,
    counter_set,
    device,
    device_name,
    fingerprint,
    memory_counter,
    mig_slices,
    slots,
)
from vgpu.node.discovery import Card

CARD = Card(
    uuid="GPU-h100", index=0, model="NVIDIA H100 80GB HBM3", memory_mib=81559, compute_capability="9.0"
)
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def consumed(dev: dict[str, Any]) -> dict[str, int]:
    (use,) = dev["consumesCounters"]
    assert use["counterSet"] == "gpu-0-mig"
    return {k: int(v["value"]) for k, v in use["counters"].items()}


def capacity() -> dict[str, int]:
    return {k: int(v["value"]) for k, v in counter_set(0)["counters"].items()}


def fits_counters(devs: list[dict[str, Any]]) -> bool:
    """What the scheduler's allocator checks: the devices' consumption within the counter set."""
    total: Counter[str] = Counter()
    for d in devs:
        total.update(consumed(d))
    have = capacity()
    return all(total[k] <= have[k] for k in total)


def test_the_counter_set_is_the_cards_slices_and_media_extensions() -> None:
    s = counter_set(3)
    assert s["name"] == "gpu-3-mig"
    assert capacity() == {**{memory_counter(i): 1 for i in range(8)}, COMPUTE_COUNTER: 7, MEDIA_COUNTER: 1}
    assert all(DNS_LABEL.match(k) for k in s["counters"])


@pytest.mark.parametrize("table", [H100_80GB, H200_141GB], ids=lambda t: t.product)
def test_every_profile_placement_is_a_device_consuming_exactly_its_slices(table: MigTable) -> None:
    offered = slots(CARD, table)
    assert len(offered) == sum(len(p.starts) for p in table.profiles) == 25
    for slot in offered:
        dev = device(slot, "580.65.06")
        p, start = slot.profile, slot.placement.start
        assert DNS_LABEL.match(dev["name"]) and dev["name"] == device_name(0, p.name, start)
        want = {memory_counter(s): 1 for s in range(start, start + p.memory_slices)}
        want[COMPUTE_COUNTER] = p.compute_slices
        if p.name.endswith("+me") or p.compute_slices == 7:
            want[MEDIA_COUNTER] = 1
        assert consumed(dev) == want, p.name
        attrs = dev["attributes"]
        assert attrs["profile"] == {"string": p.name}
        assert attrs["parentUUID"] == {"string": "GPU-h100"}
        assert attrs["placementStart"] == {"int": start} and attrs["placementSize"] == {
            "int": p.memory_slices
        }
        assert attrs["type"] == {"string": "mig"}
        assert attrs["driverVersion"] == {"version": "580.65.6"}
        assert dev["capacity"]["memory"] == {"value": str(p.memory_mib << 20)}
        assert "allowMultipleAllocations" not in dev  # a slice is given whole
        assert len(attrs) + len(dev["capacity"]) <= 32  # the API's limit


def test_the_names_on_the_h100() -> None:
    names = {s.device for s in slots(CARD, H100_80GB)}
    assert {
        "gpu-0-mig-1g-10gb-0",
        "gpu-0-mig-1g-10gb-me-6",
        "gpu-0-mig-3g-40gb-4",
        "gpu-0-mig-7g-80gb-0",
    } <= names
    assert "gpu-0-mig-1g-10gb-7" not in names  # no 1g placement at the eighth slice


def _allowed(table: MigTable, chosen: list[tuple[str, Placement]]) -> bool:
    """The card's own rules: each in turn placeable beside those before it."""
    held: list[tuple[str, Placement]] = []
    for name, place in chosen:
        if place not in free_placements(table, name, held):
            return False
        held.append((name, place))
    return True


def test_counters_allow_two_devices_exactly_when_the_card_allows_both() -> None:
    offered = slots(CARD, H100_80GB)
    for a, b in itertools.combinations(offered, 2):
        rules = _allowed(H100_80GB, [(a.profile.name, a.placement), (b.profile.name, b.placement)])
        assert fits_counters([device(a), device(b)]) == rules, (a.device, b.device)


def test_counters_allow_full_mixes_and_refuse_one_more() -> None:
    by = {s.device: s for s in slots(CARD, H100_80GB)}
    sevens = [device(by[f"gpu-0-mig-1g-10gb-{i}"]) for i in range(7)]
    assert fits_counters(sevens)
    mixes = [
        ["gpu-0-mig-4g-40gb-0", "gpu-0-mig-3g-40gb-4"],
        ["gpu-0-mig-3g-40gb-0", "gpu-0-mig-2g-20gb-4", "gpu-0-mig-1g-20gb-6"],
        ["gpu-0-mig-2g-20gb-0", "gpu-0-mig-2g-20gb-2", "gpu-0-mig-2g-20gb-4", "gpu-0-mig-1g-10gb-me-6"],
    ]
    for mix in mixes:
        devs = [device(by[n]) for n in mix]
        assert fits_counters(devs), mix
        for extra in by.values():
            if extra.device not in mix:
                assert not fits_counters([*devs, device(extra)]), (mix, extra.device)
    two_me = [device(by["gpu-0-mig-1g-10gb-me-0"]), device(by["gpu-0-mig-1g-10gb-me-1"])]
    assert not fits_counters(two_me)  # one set of media extensions per card


def test_instances_no_claim_holds_take_their_placements_off_the_offer() -> None:
    offered = slots(CARD, H100_80GB, [Placement(4, 4)])  # a 3g.40gb at 4 someone else holds
    assert all(s.placement.start + s.placement.size <= 4 for s in offered)
    assert "gpu-0-mig-4g-40gb-0" in {s.device for s in offered}


def test_the_pool_keeps_to_the_apis_limits() -> None:
    cards = [replace(CARD, uuid=f"GPU-{i}", index=i) for i in range(9)]
    cards[8] = replace(cards[8], healthy=False)
    made = mig_slices("node-a-vgpu.openaios.io", "node-a", [(c, slots(c, H100_80GB)) for c in cards])
    counters = [s for s in made if "sharedCounters" in s["spec"]]
    devices = [s for s in made if "devices" in s["spec"]]
    assert [len(s["spec"]["sharedCounters"]) for s in counters] == [8, 1]  # at most 8 sets a slice
    assert len(devices) == 9 and all(len(s["spec"]["devices"]) <= 64 for s in devices)
    assert devices[8]["spec"]["devices"] == []  # an unhealthy card offers nothing
    assert not any("sharedCounters" in s["spec"] and "devices" in s["spec"] for s in made)
    assert [s["metadata"]["name"] for s in made][:3] == [
        "node-a-vgpu.openaios.io-counters-0",
        "node-a-vgpu.openaios.io-counters-1",
        "node-a-vgpu.openaios.io-gpu-0",
    ]
    assert all(s["spec"]["nodeName"] == "node-a" and s["spec"]["driver"] == "vgpu.openaios.io" for s in made)


def test_the_fingerprint_reads_counters_as_values() -> None:
    a = mig_slices("b", "n", [(CARD, slots(CARD, H100_80GB))])[1]
    served = json.loads(json.dumps(a).replace('"value": "1"', '"value": "1.0"'))  # as a quantity may read
    assert fingerprint(a) == fingerprint(served) is not None
    less = {**a, "spec": {**a["spec"], "devices": a["spec"]["devices"][1:]}}
    assert fingerprint(less) != fingerprint(a)
    assert fingerprint({"spec": {"devices": [{"name": "x"}]}}) is None
