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
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vgpu.core.claimconfig import ConfigEntryError, Entry, VgpuConfig, check_entries, for_request
from vgpu.core.errors import FieldError, RequestError
from vgpu.core.quantity import parse_quantity
from vgpu.dra.slices import DRIVER, MIB
from vgpu.plugin.discovery import Card

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


def plan(claim: Mapping[str, Any], uid: str, cards: Mapping[str, Card], node: str) -> ClaimPlan:
    """The shares this driver prepares for ``claim`` on ``node``; ``cards`` maps the slice's device
    names to the node's healthy cards. ``ClaimError`` naming the field for anything else."""
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
    shares = tuple(
        _share(r, i, cards, node, source)
        for i, r in enumerate(results)
        if isinstance(r, Mapping) and r.get("driver") == DRIVER
    )
    if not shares:
        raise ClaimError(source, RESULTS, f"has no device of driver {DRIVER}")
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
    return ClaimPlan(namespace, name, uid, shares, reserved, configs)
