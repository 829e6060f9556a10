"""What a node could still take, measured fast: the checks and measures filter and prioritize use
for the usual pod (one container with vGPUs) without a search. Pure functions, no I/O.

:func:`quick_fits` is exact for such a pod (its vGPUs go to different cards, each checked on its
own); :class:`CardSummary` and :func:`may_fit` turn most nodes away in four numbers; the
utilisation (:func:`utilization`, :func:`quick_utilization`, and :func:`node_utilization`, the one
formula behind both and behind :mod:`vgpu.core.placement`'s ranking) is how full a node would be.
:mod:`vgpu.core.fit` holds the complete search and its reasons; a property test keeps the two in
agreement.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import NamedTuple

from vgpu.core.annotations import NodeInventory
from vgpu.core.ledger import Usage
from vgpu.core.requests import ContainerRequest
from vgpu.core.selection import Selection


def quick_fits(
    inventory: NodeInventory, usage: Mapping[str, Usage], c: ContainerRequest, selection: Selection
) -> bool:
    """Whether ``c`` (the pod's only container with vGPUs) fits: enough cards each take one vGPU.

    Exact for such a pod (its vGPUs go to different cards, each checked on its own), with no
    sorting and no plan built, stopping at the first ``c.count`` cards: what filter needs.
    """
    found = 0
    exclusive = c.cores >= 100
    for card in inventory.devices:
        if not card.healthy or selection.rules_out(card, c.count):
            continue
        if card.mig_dynamic is not None:
            return False  # MIG on demand: only the fit (vgpu/core/migfit.py) knows the placements
        mem = c.memory_mib if c.memory_mib is not None else card.memory_mib * (c.memory_percent or 0) // 100
        o = usage.get(card.uuid)
        if o is None:
            if card.split < 1 or mem > card.memory_mib or c.cores > card.cores:
                continue
        elif (
            o[3] > 0
            or (exclusive and o[2] > 0)
            or o[2] + 1 > card.split
            or o[0] + mem > card.memory_mib
            or o[1] + c.cores > card.cores
        ):
            continue
        found += 1
        if found >= c.count:
            return True
    return False


class CardSummary(NamedTuple):
    """What a node could still take, in four numbers: enough to turn most nodes away without a fit.

    Over the node's healthy cards: ``open`` cards that can take one more vGPU (not held
    exclusively, a free ``split`` slot), ``empty`` cards among them (nothing committed: only those
    can take an exclusive vGPU), and the most memory and cores still free on one open card.
    """

    open: int
    empty: int
    memory_mib: int
    cores: int


def card_summary(inventory: NodeInventory, usage: Mapping[str, Usage]) -> CardSummary:
    """The node's :class:`CardSummary` given what is committed on it (``usage``, per card uuid)."""
    open_ = empty = mem = cores = 0
    for card in inventory.devices:
        if not card.healthy or card.split < 1:
            continue
        o = usage.get(card.uuid)
        if o is None:
            om = oc = on = 0
        elif o[3] > 0 or o[2] + 1 > card.split:
            continue
        else:
            om, oc, on = o[0], o[1], o[2]
        open_ += 1
        if on == 0:
            empty += 1
        if card.memory_mib - om > mem:
            mem = card.memory_mib - om
        if card.cores - oc > cores:
            cores = card.cores - oc
    return CardSummary(open_, empty, mem, cores)


def may_fit(summary: CardSummary, c: ContainerRequest) -> bool:
    """False when the node surely cannot take ``c`` (the pod's only container with vGPUs).

    A necessary condition of :func:`quick_fits`: every card that passes it is open, has at
    least the container's memory and cores free, and is empty when the vGPU is exclusive.
    """
    if summary.open < c.count or summary.cores < c.cores:
        return False
    if c.cores >= 100 and summary.empty < c.count:
        return False
    return c.memory_mib is None or summary.memory_mib >= c.memory_mib


def quick_utilization(inventory: NodeInventory, usage: Mapping[str, Usage], c: ContainerRequest) -> float:
    """The node's utilisation with ``c``'s vGPUs added, without choosing cards (prioritize).

    With ``gpumem-percentage`` the first card's memory stands for all: a node's cards are
    normally one model.
    """
    per_card = inventory.devices[0].memory_mib if inventory.devices else 0
    mem = c.memory_on(per_card)
    return utilization(inventory, usage, {"": Usage(mem * c.count, c.cores * c.count, c.count, 0)})


_TOTALS: dict[int, tuple[NodeInventory, int, int]] = {}


def utilization(inventory: NodeInventory, usage: Mapping[str, Usage], fp: Mapping[str, Usage]) -> float:
    """How full the node would be with footprint ``fp`` added (0..1): memory and vGPU slots, averaged."""
    cached = _TOTALS.get(id(inventory))
    if cached is None or cached[0] is not inventory:
        if len(_TOTALS) > 4096:
            _TOTALS.clear()
        cached = (
            inventory,
            sum(d.memory_mib for d in inventory.devices),
            sum(d.split for d in inventory.devices),
        )
        _TOTALS[id(inventory)] = cached  # holding ``inventory`` keeps its id from being reused
    _, total_mem, total_slots = cached
    mem = slots = 0
    for u in itertools.chain(usage.values(), fp.values()):
        mem += u[0]
        slots += u[2]
    return node_utilization(total_mem, total_slots, mem, slots)


def node_utilization(total_mem: int, total_slots: int, mem: int, slots: int) -> float:
    """The one formula of how full a node is (0..1): ``mem`` of ``total_mem`` MiB and ``slots`` of
    ``total_slots`` vGPU slots taken, averaged; a node with no capacity counts as full. Used by
    :func:`utilization` and by :mod:`vgpu.core.placement`'s ranking of nodes alike."""
    if not total_mem or not total_slots:
        return 1.0
    return (mem / total_mem + slots / total_slots) / 2
