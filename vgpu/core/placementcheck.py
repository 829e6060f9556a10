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

from vgpu.core.annotations import (
    ALLOCATION_ANNOTATION,
    Allocation,
    ContainerAllocation,
    Device,
    DeviceAllocation,
)
from vgpu.core.migfit import profile_for, table_of
from vgpu.core.requests import RESOURCE_CORES, RESOURCE_GPU, RESOURCE_MEM, ContainerRequest, PodRequest
from vgpu.core.selection import KIND_MPS, Selection, card_kind


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
    and never 0 MiB (a grant of 0 bytes is no limit at all), on a card of a kind the pod takes
    (``nvidia.com/vgpu-mode``: never an MPS card for a pod that did not ask ``mps``, never a
    time-sliced one for a pod that asked only ``mps``). A container the allocation names
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
        problems += _container_problems(where, asked, given, cards, request.selection)
    for asked in request.containers:
        if asked.count and asked.name not in seen:
            problems.append(
                f"{ALLOCATION_ANNOTATION}: container {asked.name} asks for {asked.count} vGPU(s) "
                f"({RESOURCE_GPU}) but is given none"
            )
    return problems


def _container_problems(
    where: str,
    asked: ContainerRequest,
    given: ContainerAllocation,
    cards: Mapping[str, Device],
    selection: Selection,
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
        kind = card_kind(card)
        if kind not in selection.kinds:  # MPS and time-sliced containers never share a card
            problems.append(f"{where} is given card {d.uuid}, {selection.wrong_kind(kind)}")
        elif kind == KIND_MPS and asked.count > 1:
            problems.append(
                f"{where} is given MPS card {d.uuid} among {asked.count}: an MPS card takes "
                "a container of one vGPU"
            )
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
        problems += _instance_problems(where, asked, d, card)
    return problems


def _instance_problems(where: str, asked: ContainerRequest, d: DeviceAllocation, card: Device) -> list[str]:
    """On a card cut on demand, a vGPU is exactly the instance the fit would make for the request:
    the smallest profile that holds it, at one of that profile's placements (vgpu/core/migfit.py).
    A larger instance would give the container more SMs and memory than it asked for."""
    if card.mig_dynamic is None:
        if d.mig is None:
            return []
        return [
            f"{where} is given a {d.mig.profile} MIG instance on card {d.uuid}, which is not cut on demand"
        ]
    if d.mig is None:
        return [f"{where} is given card {d.uuid}, cut into MIG instances on demand, with no instance"]
    table = table_of(card)
    want = profile_for(table, asked) if table is not None else None
    if want is None or d.mig.profile != want.name:
        holds = want.name if want is not None else "none of the card's profiles"
        return [
            f"{where} is given a {d.mig.profile} MIG instance on card {d.uuid}, but the smallest profile "
            f"that holds what it asks for is {holds}"
        ]
    if d.mig.start not in want.starts:
        return [f"{where} is given a {want.name} instance at slice {d.mig.start} of card {d.uuid}, but "
                f"{want.name} starts only at {list(want.starts)}"]  # fmt: skip
    return []


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
