"""A ResourceClaim's allocation read into what this node must prepare: pure, every field checked.

The scheduler writes ``status.allocation.devices.results``: per request of the claim, the driver,
pool and device it got and, on a device that allows several allocations (ours), the
``consumedCapacity`` (``memory`` in bytes, ``cores`` in percent) and a ``shareID``. This module
keeps the results of this driver and turns each into a :class:`Share` of a card; anything it
cannot hold a container to (a missing or fractional capacity, a device this node does not have,
another node's pool, a malformed entry of this driver's configuration) is a :class:`ClaimError`
naming the field, which the kubelet shows on the pod. The allocation's configuration entries of
this driver (the class's, then the claim's: contract 8, :mod:`vgpu.core.claimconfig`) give each
request its priority and SM policy.

The tenant boundary (docs/security.md): a share is prepared only if it is what the claim's own
spec asks of its request (``spec.devices.requests``: the count, and the capacity as the card's
request policy reads it, its default where the request names none) and fits the card. Only the
scheduler writes a claim's status; this checks it did so for this claim.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vgpu.core.claimconfig import ConfigEntryError, Entry, VgpuConfig, check_entries, for_request
from vgpu.core.errors import FieldError, RequestError
from vgpu.core.quantity import parse_quantity, quantity_value
from vgpu.dra.slices import DEFAULT_CORES, DEFAULT_MEMORY_BYTES, DRIVER, MIB, memory_bytes
from vgpu.node.discovery import Card

RESULTS = "status.allocation.devices.results"
CONFIG = "status.allocation.devices.config"


class ClaimError(FieldError):
    """A claim this node cannot prepare; ``field`` is the path of the field at fault."""


@dataclass(frozen=True)
class Share:
    """One result of the claim: part of one card for one request."""

    request: str  # the request's name (``req`` or ``req/subrequest``)
    device: str  # the slice's device name, gpu-<index>
    uuid: str
    index: int
    minor: int  # /dev/nvidia<minor>
    memory_mib: int
    cores: int
    share_id: str = ""


@dataclass(frozen=True)
class ClaimPlan:
    namespace: str
    name: str
    uid: str
    shares: tuple[Share, ...]
    reserved_for: tuple[dict[str, str], ...]  # the pods the claim is reserved for (resource, name, uid)
    configs: tuple[Entry, ...] = ()  # this driver's configuration entries, the class's then the claim's
    mig: tuple[tuple[str, str], ...] = ()  # (request, device) of the results naming MIG devices

    def config(self, request: str) -> VgpuConfig:
        """What the claim and its class configure ``request`` with (contract 8)."""
        return for_request(self.configs, request)

    def requests(self) -> dict[str, list[Share]]:
        """The shares grouped by request, in the order the results list them."""
        grouped: dict[str, list[Share]] = {}
        for share in self.shares:
            grouped.setdefault(share.request, []).append(share)
        return grouped


def _mapping(value: Any) -> Mapping[str, Any]:
    """``value`` where it is an object, else empty: the checks below then name what is missing."""
    return value if isinstance(value, Mapping) else {}


def _whole(value: Any, field: str, source: str) -> int:
    try:
        return parse_quantity(value, field)
    except RequestError as err:
        raise ClaimError(source, field, err.message) from err


SPEC = "spec.devices.requests"


def _asked(spec: Any, request: str) -> tuple[str, Mapping[str, Any]] | None:
    """Where the claim's spec asks for ``request`` (``req`` or ``req/sub``) and that choice's
    fields (``deviceClassName``, ``count``, ``capacity``...); None when it names no such request."""
    main, _, sub = request.partition("/")
    items = spec if isinstance(spec, Sequence) and not isinstance(spec, (str, bytes)) else []
    for i, item in enumerate(items):
        if not isinstance(item, Mapping) or item.get("name") != main:
            continue
        if not sub:
            return f"{SPEC}[{i}].exactly", _mapping(item.get("exactly"))
        subs = item.get("firstAvailable")
        for j, choice in enumerate(subs if isinstance(subs, Sequence) else []):
            if isinstance(choice, Mapping) and choice.get("name") == sub:
                return f"{SPEC}[{i}].firstAvailable[{j}]", choice
    return None


def _expected(asked: Mapping[str, Any], total: int) -> tuple[int, int]:
    """(memory bytes, cores) the card's request policy (vgpu/dra/slices.py) gives what a request
    asks: whole MiB rounded up and whole percent rounded up, the policy's default where it names none."""
    capacity = _mapping(_mapping(asked.get("capacity")).get("requests"))
    memory = quantity_value(capacity["memory"]) if "memory" in capacity else None
    cores = quantity_value(capacity["cores"]) if "cores" in capacity else None
    want_memory = (
        max(MIB, math.ceil(memory / MIB) * MIB)
        if memory is not None
        else (DEFAULT_MEMORY_BYTES if total >= DEFAULT_MEMORY_BYTES else total)
    )
    want_cores = max(1, math.ceil(cores)) if cores is not None else DEFAULT_CORES
    return want_memory, want_cores


def _check_asked(share: Share, spec: Any, card: Card, scaling: float, at: str, source: str) -> None:
    """The share is what the claim's spec (``spec``: its :data:`SPEC`) asks of its request and fits
    the card; ClaimError else."""
    found = _asked(spec, share.request)
    if found is None:
        raise ClaimError(
            source, f"{at}.request", f"{share.request!r} is not a request of the claim's spec ({SPEC})"
        )
    where, asked = found
    total = memory_bytes(card, scaling)
    memory, cores = _expected(asked, total)
    got = share.memory_mib * MIB
    if got > total:
        raise ClaimError(
            source,
            f"{at}.consumedCapacity.memory",
            f"{share.memory_mib}Mi is more than the card has ({total // MIB}Mi)",
        )
    for what, have, want in (("memory", got, memory), ("cores", share.cores, cores)):
        if have != want:
            shown = f"{have // MIB}Mi" if what == "memory" else str(have)
            wanted = f"{want // MIB}Mi" if what == "memory" else str(want)
            raise ClaimError(
                source,
                f"{at}.consumedCapacity.{what}",
                f"is {shown}, but the claim asks for {wanted} ({where}.capacity.requests.{what}, or the "
                "card's default): the allocation is not what the claim asks for; delete the claim and its "
                "pod, and create them again for the scheduler to allocate",
            )


def _check_counts(requests: Sequence[str], spec: Any, source: str) -> None:
    """As many results per request as its spec's ``count`` (ExactCount, the default)."""
    per: dict[str, int] = {}
    for r in requests:
        per[r] = per.get(r, 0) + 1
    for request, n in per.items():
        found = _asked(spec, request)
        if found is None:
            continue  # named by _check_asked
        where, asked = found
        if asked.get("allocationMode", "ExactCount") != "ExactCount":
            continue
        count = asked.get("count", 1)
        if n != count:
            raise ClaimError(
                source,
                RESULTS,
                f"gives request {request!r} {n} device(s), but it asks for {count} ({where}.count)",
            )


def _share(result: Mapping[str, Any], i: int, cards: Mapping[str, Card], node: str, source: str) -> Share:
    at = f"{RESULTS}[{i}]"
    request = result.get("request")
    if not isinstance(request, str) or not request:
        raise ClaimError(source, f"{at}.request", "missing: the result names no request of the claim")
    pool = result.get("pool")
    if pool != node:
        raise ClaimError(
            source,
            f"{at}.pool",
            f"is {pool!r}, a device of another node: this is node {node!r}; the claim was allocated "
            "elsewhere and its pod must run there",
        )
    name = result.get("device")
    card = cards.get(name) if isinstance(name, str) else None
    if card is None:
        raise ClaimError(
            source,
            f"{at}.device",
            f"{name!r} is not a healthy card of node {node} (it has {', '.join(sorted(cards)) or 'none'}); "
            "delete the pod and its claim so that the scheduler allocates again",
        )
    consumed = result.get("consumedCapacity")
    if not isinstance(consumed, Mapping):
        raise ClaimError(
            source,
            f"{at}.consumedCapacity",
            "missing: the scheduler gave the whole device without consuming capacity; enable the "
            "DRAConsumableCapacity feature gate on the API server and the scheduler (Kubernetes 1.34+)",
        )
    if "memory" not in consumed:
        raise ClaimError(source, f"{at}.consumedCapacity.memory", "missing: the share's device memory")
    memory = _whole(consumed["memory"], f"{at}.consumedCapacity.memory", source)
    if memory < MIB or memory % MIB:
        raise ClaimError(
            source,
            f"{at}.consumedCapacity.memory",
            f"must be whole MiB, at least 1Mi, got {consumed['memory']!r}: ask for e.g. 3000Mi",
        )
    if "cores" not in consumed:
        raise ClaimError(source, f"{at}.consumedCapacity.cores", "missing: the share's percent of the card")
    cores = _whole(consumed["cores"], f"{at}.consumedCapacity.cores", source)
    if not 1 <= cores <= 100:
        raise ClaimError(
            source, f"{at}.consumedCapacity.cores", f"must be 1..100 percent of the card, got {cores}"
        )
    share_id = result.get("shareID") or ""
    return Share(
        request=request,
        device=str(name),
        uuid=card.uuid,
        index=card.index,
        minor=card.minor if card.minor >= 0 else card.index,
        memory_mib=memory // MIB,
        cores=cores,
        share_id=str(share_id),
    )


def _mig_result(result: Mapping[str, Any], i: int, node: str, source: str) -> tuple[str, str]:
    """A result naming a MIG device (vgpu/dra/migslices.py): the whole device, no capacity."""
    at = f"{RESULTS}[{i}]"
    request = result.get("request")
    if not isinstance(request, str) or not request:
        raise ClaimError(source, f"{at}.request", "missing: the result names no request of the claim")
    if result.get("pool") != node:
        raise ClaimError(
            source,
            f"{at}.pool",
            f"is {result.get('pool')!r}, a device of another node: this is node {node!r}",
        )
    return request, str(result["device"])


def plan(
    claim: Mapping[str, Any],
    uid: str,
    cards: Mapping[str, Card],
    node: str,
    memory_scaling: float = 1.0,
    mig_devices: Collection[str] = (),
) -> ClaimPlan:
    """The shares this driver prepares for ``claim`` on ``node``; ``cards`` maps the slice's device
    names to the node's healthy cards (their memory offered at ``memory_scaling``, as the slice
    offers it), ``mig_devices`` names the MIG devices of the node's pool (given whole: results
    naming them go to ``ClaimPlan.mig``). ``ClaimError`` naming the field for anything else."""
    meta = _mapping(claim.get("metadata"))
    namespace, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
    source = f"ResourceClaim {namespace}/{name}"
    if meta.get("uid") != uid:
        raise ClaimError(
            source,
            "metadata.uid",
            f"is {meta.get('uid')!r}, the kubelet asked for {uid!r}: the claim was deleted and made again",
        )
    status = _mapping(claim.get("status"))
    allocation = status.get("allocation")
    if not isinstance(allocation, Mapping):
        raise ClaimError(source, "status.allocation", "missing: the claim is not allocated yet")
    results = _mapping(allocation.get("devices")).get("results") or []
    if not isinstance(results, list):
        raise ClaimError(source, RESULTS, "must be a list")
    mine = [(i, r) for i, r in enumerate(results) if isinstance(r, Mapping) and r.get("driver") == DRIVER]
    whole = {i for i, r in mine if isinstance(r.get("device"), str) and r["device"] in mig_devices}
    ours = [(i, r) for i, r in mine if i not in whole]
    migs = tuple(_mig_result(r, i, node, source) for i, r in mine if i in whole)
    shares = tuple(_share(r, i, cards, node, source) for i, r in ours)
    if not shares and not migs:
        raise ClaimError(source, RESULTS, f"has no device of driver {DRIVER}")
    spec = _mapping(_mapping(claim.get("spec")).get("devices")).get("requests")
    for (i, _), share in zip(ours, shares, strict=True):
        _check_asked(share, spec, cards[share.device], memory_scaling, f"{RESULTS}[{i}]", source)
    for request, _ in migs:
        if _asked(spec, request) is None:
            raise ClaimError(source, RESULTS, f"{request!r} is not a request of the claim's spec ({SPEC})")
    _check_counts([s.request for s in shares] + [r for r, _ in migs], spec, source)
    try:
        configs = tuple(check_entries(_mapping(allocation.get("devices")).get("config"), CONFIG, source))
    except ConfigEntryError as err:
        raise ClaimError(
            err.source, err.field, f"{err.message} (fix the claim or its DeviceClass and create it again)"
        ) from err
    refs = status.get("reservedFor")
    reserved = tuple(
        {k: str(ref.get(k) or "") for k in ("resource", "name", "uid")}
        for ref in (refs if isinstance(refs, list) else [])
        if isinstance(ref, Mapping)
    )
    return ClaimPlan(namespace, name, uid, shares, reserved, configs, migs)
