"""Whether a placement (contract 3's allocation) gives a pod exactly what its spec asks for.

The tenant boundary (docs/security.md): a pod gets only what the scheduler gave it. The
allocation annotation is written by the extender alone (an admission policy refuses anyone
else), but the node does not take that on trust: before it hands a container its grant, the
device plugin re-derives each container's request from the pod's own spec with the parser the
extender uses (:func:`vgpu.core.requests.parse_pod`) and refuses an allocation that differs from
it in count, memory or cores, or that does not fit the card it names. The extender asks the same
of a placement it did not write itself (one it finds after its own restart).

Pure: the pod's parsed request, the allocation and the node's cards as its inventory describes
them (contract 2, memory and cores with the node's scaling applied) go in; what is wrong comes out,
one line per problem, each naming the container, the card and the resource to compare.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from vgpu.core.annotations import ALLOCATION_ANNOTATION, Allocation, ContainerAllocation, Device
from vgpu.core.requests import RESOURCE_CORES, RESOURCE_GPU, RESOURCE_MEM, ContainerRequest, PodRequest


def _memory_source(req: ContainerRequest) -> str:
    if req.memory_percent is not None:
        return f"nvidia.com/gpumem-percentage {req.memory_percent}"
    return f"{RESOURCE_MEM} {req.memory_mib}"


def placement_problems(request: PodRequest, allocation: Allocation, cards: Mapping[str, Device]) -> list[str]:
    """What in ``allocation`` differs from ``request`` on the node whose ``cards`` (by UUID) it
    names; empty when the allocation is exactly what the pod asks for.

    Per container with vGPUs: as many devices as ``nvidia.com/gpu``, each on a different card of
    the node, each with the memory the request gives on that card (``gpumem``, or the percentage
    of the card's memory) and the cores it asks for (``gpucores``), never more than the card has
    and never 0 MiB (a grant of 0 bytes is no limit at all). A container the allocation names
    that the spec does not, or that asks for no vGPU, is a problem too; so is a container that
    asks for vGPUs and is given none.
    """
    by_name = {c.name: c for c in request.containers}
    problems: list[str] = []
    seen: set[str] = set()
    for given in allocation.containers:
        where = f"{ALLOCATION_ANNOTATION}: container {given.name}"
        if given.name in seen:
            problems.append(f"{where} is named twice")
            continue
        seen.add(given.name)
        asked = by_name.get(given.name)
        if asked is None:
            problems.append(f"{where} is not a container of the pod")
            continue
        problems += _container_problems(where, asked, given, cards)
    for asked in request.containers:
        if asked.count and asked.name not in seen:
            problems.append(
                f"{ALLOCATION_ANNOTATION}: container {asked.name} asks for {asked.count} vGPU(s) "
                f"({RESOURCE_GPU}) but is given none"
            )
    return problems


def _container_problems(
    where: str, asked: ContainerRequest, given: ContainerAllocation, cards: Mapping[str, Device]
) -> list[str]:
    problems: list[str] = []
    if not asked.count:
        return [f"{where} asks for no vGPU but is given {len(given.devices)}"] if given.devices else []
    if len(given.devices) != asked.count:
        problems.append(
            f"{where} is given {len(given.devices)} vGPU(s) but asks for {asked.count} ({RESOURCE_GPU})"
        )
    uuids = [d.uuid for d in given.devices]
    if len(set(uuids)) != len(uuids):
        problems.append(f"{where} is given two vGPUs on one card (each vGPU must be on its own card)")
    for d in given.devices:
        card = cards.get(d.uuid)
        if card is None:
            problems.append(f"{where} is given card {d.uuid}, which is not a card of this node")
            continue
        if card.resource != asked.resource:
            problems.append(
                f"{where} is given {d.uuid}, offered as {card.resource}, but asks for {asked.resource}"
            )
            continue
        want = asked.memory_on(card.memory_mib)
        if d.memory_mib != want:
            problems.append(
                f"{where} is given {d.memory_mib} MiB on card {d.uuid} but asks for {want} MiB "
                f"({_memory_source(asked)})"
            )
        if d.memory_mib < 1:
            problems.append(f"{where} is given 0 MiB on card {d.uuid}: a grant must hold at least 1 MiB")
        if d.memory_mib > card.memory_mib:
            problems.append(
                f"{where} is given {d.memory_mib} MiB on card {d.uuid}, more than the card has "
                f"({card.memory_mib} MiB)"
            )
        if d.cores != asked.cores:
            problems.append(
                f"{where} is given {d.cores} % of card {d.uuid} but asks for {asked.cores} % "
                f"({RESOURCE_CORES})"
            )
        most = min(card.cores, 100)
        if d.cores > most:
            problems.append(f"{where} is given {d.cores} % of card {d.uuid}, more than it has ({most} %)")
    return problems


def at_least_requested(
    request: PodRequest, allocation: Allocation, cards: Mapping[str, Device]
) -> Allocation:
    """``allocation`` with each known card's memory and cores raised to what the pod asks for
    there, where the annotation says less: what a ledger books for a placement it did not write
    and that :func:`placement_problems` finds wrong, so that it never counts less than the pod
    could hold (the node refuses such a pod, and it frees its room when it fails)."""
    by_name = {c.name: c for c in request.containers}
    containers: list[ContainerAllocation] = []
    for given in allocation.containers:
        asked = by_name.get(given.name)
        devices: Sequence = given.devices
        if asked is not None and asked.count:
            devices = tuple(
                replace(
                    d,
                    memory_mib=max(d.memory_mib, asked.memory_on(cards[d.uuid].memory_mib)),
                    cores=max(d.cores, asked.cores),
                )
                if d.uuid in cards
                else d
                for d in given.devices
            )
        containers.append(ContainerAllocation(given.name, tuple(devices)))
    return replace(allocation, containers=tuple(containers))
