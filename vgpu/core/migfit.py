"""The fit on cards cut into MIG instances on demand (``migStrategy: dynamic``). Pure, no I/O.

Such a card (a :class:`~vgpu.core.annotations.Device` with ``mig_dynamic``) takes a vGPU as a
whole MIG instance: the smallest profile of its table that holds the container's memory
(``gpumem``, or ``gpumem-percentage`` as a share of the card's eight memory slices) and its
compute (``gpucores`` as a share of the seven compute slices), at a free placement. A placement
is free when neither an instance the node reports (``mig_dynamic.instances``, leftovers waiting
to be reclaimed among them) nor a booking in the ledger overlaps it.

Bookings live in the ledger beside each card's usage, under a key of their own per placement
(:func:`vgpu.core.ledger.mig_key`), so two pods never get overlapping placements: filter, bind,
a restart of the extender (which books every pod's allocation again) all see them.

The choice of card and placement keeps the largest profiles possible: of all (card, placement)
pairs, the one whose card loses the least room for the largest profile, then the next largest
(:func:`vgpu.core.mig.room_after`); then the fuller card (packing), then the lower index. Each
vGPU of a container goes to a different card; every container gets instances of its own (init
containers too: kubelet allocates all of a pod's containers before the first starts). The choice
is greedy, vGPU by vGPU, which for one container of one vGPU (the usual MIG pod) is exact.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from vgpu.core.annotations import (
    Allocation,
    ContainerAllocation,
    Device,
    DeviceAllocation,
    MigDynamic,
    MigGrant,
)
from vgpu.core.ledger import Usage, footprint, parse_mig_key
from vgpu.core.mig import (
    COMPUTE_SLICES,
    MEMORY_SLICES,
    TABLES,
    MigTable,
    Placement,
    Profile,
    best_placement,
    room_after,
)
from vgpu.core.requests import ContainerRequest, PodRequest


@dataclass(frozen=True)
class Outcome:
    """A plan (the allocation and its footprint) or, with ``reason``, why not."""

    plan: tuple[Allocation, dict[str, Usage]] | None = None
    reason: str = ""
    unresolvable: bool = False


def dynamic_cards(devices: Sequence[Device]) -> list[Device]:
    return [d for d in devices if d.mig_dynamic is not None]


def table_of(card: Device) -> MigTable | None:
    if card.mig_dynamic is None:
        return None
    return next((t for t in TABLES if t.product == card.mig_dynamic.table), None)


def profile_for(table: MigTable, c: ContainerRequest) -> Profile | None:
    """The smallest profile (fewest memory slices, then compute slices) holding one vGPU of
    ``c``; ``+me`` profiles are never chosen for a plain request. None when none holds it."""
    found = [
        p
        for p in table.profiles
        if not p.media_extensions
        and (
            p.memory_mib >= c.memory_mib
            if c.memory_mib is not None
            else p.memory_slices * 100 >= (c.memory_percent or 0) * MEMORY_SLICES
        )
        and p.compute_slices * 100 >= c.cores * COMPUTE_SLICES
    ]
    return min(found, key=lambda p: (p.memory_slices, p.compute_slices, p.memory_mib), default=None)


def held(card: Device, table: MigTable, usage: Mapping[str, Usage]) -> list[tuple[str, Placement]]:
    """What takes the card's slices: the instances it reports and the ledger's bookings on it."""
    assert card.mig_dynamic is not None
    out = {(i.profile, Placement(i.start, i.size)) for i in card.mig_dynamic.instances}
    for key, u in usage.items():
        parsed = parse_mig_key(key)
        if parsed is None or parsed[0] != card.uuid or u.exclusive <= 0 or not table.has(parsed[1]):
            continue
        p = table.profile(parsed[1])
        out.add((p.name, Placement(parsed[2], p.memory_slices)))
    return sorted(out, key=lambda x: (x[1].start, x[0]))


def _wanted(c: ContainerRequest) -> str:
    mem = (
        f"{c.memory_mib} MiB"
        if c.memory_mib is not None
        else f"{c.memory_percent} percent of a card's memory"
    )
    cores = f" and {c.cores} percent of the cores" if c.cores else ""
    return f"container {c.name!r}, which needs {c.count} vGPU(s) of {mem}{cores}"


def _place(
    c: ContainerRequest,
    cards: Sequence[Device],
    holding: dict[str, list[tuple[str, Placement]]],
    pod: PodRequest,
    reasons: Counter[str],
) -> list[tuple[Device, Profile, Placement]]:
    """Each vGPU of ``c`` on its own card; fewer than ``c.count`` when the node runs short."""
    chosen: list[tuple[Device, Profile, Placement]] = []
    for _ in range(c.count):
        reasons.clear()  # why the last vGPU found no card: the one that falls short
        best: tuple[tuple[object, ...], Device, Profile, Placement] | None = None
        for card in cards:
            table = table_of(card)
            if table is None:
                reasons["of a MIG table this scheduler does not know"] += 1
                continue
            if any(card is d for d, _, _ in chosen):
                continue
            if not card.healthy:
                reasons["unhealthy"] += 1
                continue
            why = pod.selection.why_not_card(card)
            if why is not None:
                reasons[why] += 1
                continue
            profile = profile_for(table, c)
            if profile is None:
                largest = max(table.profiles, key=lambda p: p.memory_slices)
                reasons[
                    f"with no MIG profile that large (the largest, {largest.name}, "
                    f"has {largest.memory_mib} MiB)"
                ] += 1
                continue
            now = holding[card.uuid]
            spot = best_placement(table, profile, now)
            if spot is None:
                reasons[f"no free {profile.name} placement"] += 1
                continue
            before, after = room_after(table, now), room_after(table, [*now, (profile.name, spot)])
            loss = tuple(b - a for a, b in zip(after, before, strict=True))
            free = MEMORY_SLICES - sum(pl.size for _, pl in now)
            key = (loss, free, card.index)
            if best is None or key < best[0]:
                best = (key, card, profile, spot)
        if best is None:
            return chosen
        _, card, profile, spot = best
        holding[card.uuid].append((profile.name, spot))
        chosen.append((card, profile, spot))
    return chosen


def _run(
    node: str, cards: Sequence[Device], usage: Mapping[str, Usage], pod: PodRequest
) -> tuple[Allocation | None, str]:
    holding = {}
    for card in cards:
        table = table_of(card)
        holding[card.uuid] = held(card, table, usage) if table is not None else []
    containers = []
    for c in pod.containers:
        if c.count == 0:
            continue
        reasons: Counter[str] = Counter()
        chosen = _place(c, cards, holding, pod, reasons)
        if len(chosen) < c.count:
            text = ", ".join(
                f"{n} card(s) {why}" for why, n in sorted(reasons.items(), key=lambda x: (-x[1], x[0]))
            )
            return None, f"{_wanted(c)}: {len(chosen)} MIG card(s) fit; {text or 'too few cards in MIG mode'}"
        devices = tuple(
            DeviceAllocation(
                card.uuid, c.memory_on(card.memory_mib), c.cores, MigGrant(profile.name, spot.start)
            )
            for card, profile, spot in chosen
        )
        containers.append(ContainerAllocation(c.name, devices))
    return Allocation(node, tuple(containers)), ""


def fit_dynamic(node: str, devices: Sequence[Device], usage: Mapping[str, Usage], pod: PodRequest) -> Outcome:
    """Place ``pod`` on the node's cards cut on demand, given the ledger's ``usage`` of the node."""
    cards = dynamic_cards(devices)
    allocation, why = _run(node, cards, usage, pod)
    if allocation is not None:
        return Outcome((allocation, footprint(allocation)))
    empty = [replace(d, mig_dynamic=MigDynamic(d.mig_dynamic.table)) for d in cards if d.mig_dynamic]
    never, never_why = _run(node, empty, {}, pod)
    if never is None:  # not even on empty cards: the empty cards' reason is the decisive one
        return Outcome(reason=f"could never hold {never_why}", unresolvable=True)
    return Outcome(reason=f"had no MIG room now for {why}")
