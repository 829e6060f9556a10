"""DRA objects as a user writes them for the vgpu driver: a ResourceClaim asking the DeviceClass
for memory and cores, its template, and the driver's configuration entry (contract 8)."""

from __future__ import annotations

from typing import Any

from vgpu.core.claimconfig import API_VERSION, DRIVER, KIND


def vgpu_config(requests: list[str] | None = None, **params: Any) -> dict[str, Any]:
    """One entry of ``spec.devices.config`` for the vgpu driver, ``params`` its VgpuConfig fields."""
    entry: dict[str, Any] = {
        "opaque": {"driver": DRIVER, "parameters": {"apiVersion": API_VERSION, "kind": KIND, **params}}
    }
    if requests is not None:
        entry["requests"] = requests
    return entry


def devices(
    memory: str = "3000Mi", cores: str = "30", config: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """``spec.devices`` of a claim: one request ``gpu`` of the class ``vgpu.openaios.io``."""
    out: dict[str, Any] = {
        "requests": [
            {
                "name": "gpu",
                "exactly": {
                    "deviceClassName": DRIVER,
                    "capacity": {"requests": {"memory": memory, "cores": cores}},
                },
            }
        ]
    }
    if config is not None:
        out["config"] = config
    return out


def resource_claim(name: str, namespace: str = "default", **spec: Any) -> dict[str, Any]:
    """A ResourceClaim of :func:`devices` (``spec``: its arguments)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": devices(**spec)},
    }


def claim_template(name: str, namespace: str = "default", **spec: Any) -> dict[str, Any]:
    """A ResourceClaimTemplate of :func:`devices` (``spec``: its arguments)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"spec": {"devices": devices(**spec)}},
    }


def allocation_result(
    pool: str,
    memory: str = "3000Mi",
    cores: Any = "30",
    share_id: str = "share-1",
    **over: Any,
) -> dict[str, Any]:
    """One entry of ``status.allocation.devices.results`` as kube-scheduler writes it for a share of
    ``gpu-0`` in ``pool`` (``over``: other fields, e.g. ``request`` or ``device``)."""
    result: dict[str, Any] = {
        "request": "gpu",
        "driver": DRIVER,
        "pool": pool,
        "device": "gpu-0",
        "consumedCapacity": {"memory": memory, "cores": cores},
        "shareID": share_id,
    }
    result.update(over)
    return result


def asked_for(results: list[dict[str, Any]]) -> dict[str, Any]:
    """``spec.devices`` of the claim that ``results`` answer: per request (``req``, or ``req/sub`` of
    a ``firstAvailable``), as many devices as it got, asking the capacity it consumed, as the node's
    check of a claim (vgpu/dra/claims.py) wants the spec and the scheduler's status to agree."""
    requests: dict[str, dict[str, Any]] = {}
    for r in results:
        main, _, sub = str(r.get("request", "gpu")).partition("/")
        choice = {"deviceClassName": DRIVER, "count": 0}
        consumed = r.get("consumedCapacity")
        if isinstance(consumed, dict):
            choice["capacity"] = {"requests": {k: str(v) for k, v in consumed.items()}}
        item = requests.setdefault(main, {"name": main})
        if sub:
            subs = item.setdefault("firstAvailable", [])
            found = next((c for c in subs if c["name"] == sub), None)
            if found is None:
                found = {"name": sub, **choice}
                subs.append(found)
            found["count"] += 1
        else:
            item.setdefault("exactly", choice)["count"] += 1
    return {"requests": list(requests.values())}


def resource_health(pod: dict[str, Any], container: int = 0) -> dict[str, tuple[str, str]]:
    """The kubelet's word on the devices of a pod's container (``allocatedResourcesStatus``, from
    the DRA plugin's health stream): resource ID -> (health, message)."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    if len(statuses) <= container:
        return {}
    return {
        str(r.get("resourceID", "")): (str(r.get("health", "")), str(r.get("message", "")))
        for s in statuses[container].get("allocatedResourcesStatus") or []
        for r in s.get("resources") or []
    }
