"""The tenant boundary's admission rules (docs/security.md), as the webhook checks them.

The chart's ValidatingAdmissionPolicies (charts/vgpu/templates/tenant-boundary.yaml) hold the
same rules in CEL, checked by the API server itself; the webhook checks them where the policies
are off (``tenantBoundary.policies: false``, clusters before 1.30) and, for the pods it sees at
creation, beside them. The wording of each refusal is the policies' own.

- placements: the annotations ``vgpu.openaios.io/allocation``, ``phase`` and ``reason`` are set,
  changed or removed only by the scheduler's account, and ``phase`` and ``reason`` also by the
  device plugin of the node the pod is bound to (its token's node claim).
- priority: ``nvidia.com/priority: 0`` and a claim's ``VgpuConfig`` priority 0 only in the
  namespaces the cluster admin lists.

Pure: who asks (user name and extra), what the object was and becomes go in; a refusal (a
message that names the rule and the fix) or None comes out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from vgpu.core.annotations import ALLOCATION_ANNOTATION, PHASE_ANNOTATION, REASON_ANNOTATION

PLACEMENT_KEYS = (ALLOCATION_ANNOTATION, PHASE_ANNOTATION, REASON_ANNOTATION)
# The node a ServiceAccount token was issued on (Kubernetes 1.32+ puts it in the user's extra).
NODE_CLAIM = "authentication.kubernetes.io/node-name"


@dataclass(frozen=True)
class Boundary:
    """Who writes placements, and where high priority is allowed.

    ``scheduler``: the user name of the scheduler's account (kube-scheduler and the extender);
    ``node_agent``: the device plugin's; empty: placements are not checked here.
    """

    scheduler: str = ""
    node_agent: str = ""
    high_priority_namespaces: tuple[str, ...] = ()

    @property
    def guards_placements(self) -> bool:
        return bool(self.scheduler)


def _annotations(obj: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        return {}
    meta = obj.get("metadata")
    found = meta.get("annotations") if isinstance(meta, Mapping) else None
    return found if isinstance(found, Mapping) else {}


def changed_placement_keys(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> list[str]:
    """The placement annotations that ``new`` sets, changes or removes relative to ``old``
    (None: the object is being created)."""
    before, after = _annotations(old), _annotations(new)
    return [k for k in PLACEMENT_KEYS if (k in before, before.get(k)) != (k in after, after.get(k))]


def node_claim(extra: Mapping[str, Any] | None) -> str:
    """The node a request's token names (its user's extra), or ""."""
    values = (extra or {}).get(NODE_CLAIM) if isinstance(extra, Mapping) else None
    if isinstance(values, list) and values and isinstance(values[0], str):
        return values[0]
    return ""


def placement_refusal(
    boundary: Boundary,
    user: str,
    extra: Mapping[str, Any] | None,
    old: Mapping[str, Any] | None,
    new: Mapping[str, Any] | None,
    subresource: str = "",
) -> str | None:
    """Why this write of a pod (or its Binding) may not change its placement, or None.

    ``old`` is the pod before an update (None at creation), ``new`` the object written."""
    changed = changed_placement_keys(old, new)
    if not changed or not boundary.guards_placements or user == boundary.scheduler:
        return None
    if user != boundary.node_agent:
        return (
            "vgpu.openaios.io/allocation, phase and reason are written by the vgpu scheduler alone, "
            f"never by {user}: a pod gets only what the scheduler gives it. Create the pod without them "
            "(the tenant boundary, docs/security.md)"
        )
    if ALLOCATION_ANNOTATION in changed:
        return (
            "the vgpu device plugin writes a pod's phase and reason, never its allocation (the scheduler's)"
        )
    node = node_claim(extra)
    spec = old.get("spec") if isinstance(old, Mapping) and not subresource else None
    pod_node = str(spec.get("nodeName") or "") if isinstance(spec, Mapping) else ""
    if node and pod_node == node:
        return None
    return (
        f"the vgpu device plugin of node {node or '(its token names no node)'} may write the phase of pods "
        f"bound to its own node only, not of a pod {'on node ' + pod_node if pod_node else 'on no node'}"
    )


POD_PRIORITY = "nvidia.com/priority: 0"
CLAIM_PRIORITY = "VgpuConfig priority: 0"


def priority_refusal(
    boundary: Boundary, namespace: str, priorities: Iterable[int], what: str = POD_PRIORITY
) -> str | None:
    """Why an object in ``namespace`` may not ask for priority 0, or None. ``priorities``: a pod's
    containers' (``what``: :data:`POD_PRIORITY`), as :func:`vgpu.core.requests.parse_pod` read
    them, or the values a claim's or template's vgpu entries set (:data:`CLAIM_PRIORITY`). A
    DeviceClass is the admin's: never asked."""
    if namespace in boundary.high_priority_namespaces or 0 not in priorities:
        return None
    return (
        f"{what} (high priority: every priority-1 container on the card yields to it) is allowed only in "
        "the namespaces the cluster admin lists in the chart value tenantBoundary.highPriorityNamespaces, "
        f"and {namespace} is not one of them: drop it (priority 1 is the default), or ask the admin to "
        "add the namespace"
    )
