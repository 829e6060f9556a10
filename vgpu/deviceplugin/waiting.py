"""Which pods bound to this node wait for Allocate, and which of them the node refuses.

A pod waits when the extender bound it here (phase ``bound``, contract 3) and it neither finished
nor is being deleted. Its placement is served only if it is exactly what the pod's own spec asks
for: the tenant boundary (docs/security.md), re-derived with the extender's own parser
(:func:`vgpu.core.requests.parse_pod`) and compared by :func:`vgpu.core.placementcheck.placement_problems`.
The pods that cannot be served are named, with why, for Allocate's error; those whose placement
is not what they ask for are also handed back for the node to tell them (phase ``failed``, an Event).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vgpu.core.annotations import (
    ALLOCATION_ANNOTATION,
    PHASE_ANNOTATION,
    PHASE_BOUND,
    Allocation,
    Device,
    decode_allocation,
)
from vgpu.core.errors import AnnotationError, RequestError
from vgpu.core.placementcheck import placement_problems
from vgpu.core.requests import PodRequest, parse_pod
from vgpu.node.config import NodeConfig

Obj = Mapping[str, Any]


@dataclass(frozen=True)
class Waiting:
    """A pod bound here whose placement the node serves."""

    namespace: str
    name: str
    uid: str
    created: str
    allocation: Allocation
    order: tuple[str, ...]  # containers with vGPUs, in the order kubelet starts them
    priorities: Mapping[str, str]


@dataclass
class Found:
    waiting: list[Waiting] = field(default_factory=list)
    # "<namespace>/<name> (why)" of each bound pod that cannot be served, for Allocate's error
    malformed: list[str] = field(default_factory=list)
    # (pod, problems) of each pod whose placement is not what it asks for
    refused: list[tuple[Obj, list[str]]] = field(default_factory=list)


def meta_of(pod: Obj) -> Obj:
    meta = pod.get("metadata") or {}
    return meta if isinstance(meta, Mapping) else {}


def pod_ref(pod: Obj) -> str:
    m = meta_of(pod)
    return f"{m.get('namespace', '?')}/{m.get('name', '?')}"


def kubelet_order(pod: Obj, allocation: Allocation) -> tuple[str, ...]:
    spec = pod.get("spec") or {}
    names = [c.get("name") for c in (spec.get("initContainers") or [])] + [
        c.get("name") for c in (spec.get("containers") or [])
    ]
    wanted = {c.name for c in allocation.containers if c.devices}
    ordered = [n for n in names if n in wanted]
    # Containers the annotation names but the spec does not are refused by the placement check.
    return tuple(ordered + [c.name for c in allocation.containers if c.devices and c.name not in ordered])


def priorities(request: PodRequest) -> dict[str, str]:
    """Each container's ``nvidia.com/priority`` as the parser read it (contract 1)."""
    return {c.name: str(c.priority) for c in request.containers}


def _asks_for_devices(pod: Obj, resource: str) -> bool:
    spec = pod.get("spec") or {}
    for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        if resource in (((c.get("resources") or {}).get("limits")) or {}):
            return True
    return False


def find_waiting(pods: Sequence[Obj], node: str, config: NodeConfig, cards: Mapping[str, Device]) -> Found:
    """Sort the pods bound to ``node`` (``cards``: its inventory, by UUID) into waiting, malformed
    and refused; pods that finished, are being deleted or were already served are passed over."""
    found = Found()
    for pod in pods:
        meta = meta_of(pod)
        annotations = meta.get("annotations") or {}
        if meta.get("deletionTimestamp"):
            continue
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue  # kubelet rejected it (UnexpectedAdmissionError...) or it is done: not waiting
        if PHASE_ANNOTATION not in annotations and ALLOCATION_ANNOTATION not in annotations:
            if _asks_for_devices(pod, config.resource_name):
                found.malformed.append(
                    f"{pod_ref(pod)} (asks for {config.resource_name} but has no "
                    f"{ALLOCATION_ANNOTATION}: it was not placed by the vgpu scheduler; "
                    "check its schedulerName and the admission webhook)"
                )
            continue
        if annotations.get(PHASE_ANNOTATION) != PHASE_BOUND:
            continue
        try:
            allocation = decode_allocation(annotations.get(ALLOCATION_ANNOTATION))
        except AnnotationError as err:
            found.malformed.append(f"{pod_ref(pod)} ({err})")
            continue
        if allocation.node != node:
            found.malformed.append(
                f"{pod_ref(pod)} ({ALLOCATION_ANNOTATION}: node: names {allocation.node!r}, "
                f"but the pod runs on {node!r})"
            )
            continue
        try:
            request = parse_pod(pod, config.request_settings)
            problems = placement_problems(request, allocation, cards)
        except RequestError as err:
            problems = [f"its spec: {err}"]
        if problems:
            found.malformed.append(f"{pod_ref(pod)} ({'; '.join(problems)})")
            found.refused.append((pod, problems))
            continue
        found.waiting.append(
            Waiting(
                namespace=str(meta.get("namespace", "")),
                name=str(meta.get("name", "")),
                uid=str(meta.get("uid", "")),
                created=str(meta.get("creationTimestamp", "")),
                allocation=allocation,
                order=kubelet_order(pod, allocation),
                priorities=priorities(request),
            )
        )
    return found
