"""Pods as the tests write them: what a user submits (:func:`pod`, :func:`container`) and what the
scheduler leaves for the device plugin (:func:`bound_pod`, with the annotations of
contract 3 in docs/contracts.md).

Every field a test does not name is left out, so the API server fills its defaults; a test whose
point is a manifest's literal shape keeps that manifest literal.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from vgpu.core.annotations import (
    ALLOCATION_ANNOTATION,
    PHASE_ANNOTATION,
    Allocation,
    ContainerAllocation,
    DeviceAllocation,
    encode_allocation,
)

IMAGE = "cuda:fake"


def container(
    name: str = "main", image: str = IMAGE, limits: Mapping[str, str] | None = None, **vgpu: int | str
) -> dict[str, Any]:
    """A container with ``nvidia.com/<key>`` limits from the keywords (``gpu=1, gpumem=3000,
    gpucores=30, priority=0, gpumem_percentage=50``: ``_`` becomes ``-``) and any other ``limits``."""
    wanted = {f"nvidia.com/{k.replace('_', '-')}": str(v) for k, v in vgpu.items()}
    return {"name": name, "image": image, "resources": {"limits": {**wanted, **(limits or {})}}}


def pod(
    name: str,
    *containers: dict[str, Any],
    namespace: str = "default",
    init: Iterable[dict[str, Any]] = (),
    annotations: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
    scheduler: str | None = None,
    node: str | None = None,
    node_selector: Mapping[str, str] | None = None,
    tolerations: Sequence[Mapping[str, str]] | None = None,
    grace: int | None = None,
    uid: str | None = None,
    created: str | None = None,
) -> dict[str, Any]:
    """A v1 Pod manifest (a dict, ready for ``json.dumps``); one plain ``main`` container when none
    is given. ``grace`` is terminationGracePeriodSeconds, ``node`` spec.nodeName."""
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    value: Any
    for key, value in (
        ("uid", uid),
        ("creationTimestamp", created),
        ("labels", labels),
        ("annotations", annotations),
    ):
        if value is not None:
            metadata[key] = dict(value) if isinstance(value, Mapping) else value
    spec: dict[str, Any] = {}
    for key, value in (
        ("schedulerName", scheduler),
        ("nodeName", node),
        ("nodeSelector", node_selector),
        ("tolerations", tolerations),
        ("terminationGracePeriodSeconds", grace),
    ):
        if value is not None:
            spec[key] = dict(value) if isinstance(value, Mapping) else value
    init = list(init)
    if init:
        spec["initContainers"] = init
    spec["containers"] = list(containers) or [container()]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def bound_pod(
    name: str,
    node: str,
    devices: Mapping[str, Sequence[tuple[str, int, int]]],
    *,
    init: Iterable[str] = (),
    annotation: str | None = None,
    priority: Mapping[str, str] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """A pod bound to ``node`` as the extender leaves it: per container name its shares
    ``(card UUID, memory MiB, cores %)`` in the allocation annotation (or ``annotation`` verbatim),
    phase ``bound``, and the limits that ask for them (``nvidia.com/gpu``, the number of shares;
    ``gpumem`` and ``gpucores``, the first share's, as the node checks them). Containers named in
    ``init`` are init containers; ``priority`` sets a container's ``nvidia.com/priority``. Other
    keywords go to :func:`pod`."""
    alloc = Allocation(
        node,
        tuple(
            ContainerAllocation(c, tuple(DeviceAllocation(u, m, k) for u, m, k in devs))
            for c, devs in devices.items()
            if devs
        ),
    )

    def spec(c: str) -> dict[str, Any]:
        # the limits the extender read the shares from: a node checks the placement against them
        shares = devices.get(c)
        limits = {}
        if shares:
            limits = {
                "nvidia.com/gpu": str(len(shares)),
                "nvidia.com/gpumem": str(shares[0][1]),
                "nvidia.com/gpucores": str(shares[0][2]),
            }
        if priority and c in priority:
            limits["nvidia.com/priority"] = priority[c]
        return container(c, limits=limits)

    init = tuple(init)
    annotations = {
        ALLOCATION_ANNOTATION: annotation if annotation is not None else encode_allocation(alloc),
        PHASE_ANNOTATION: "bound",
    }
    made = pod(name, init=[spec(c) for c in init], annotations=annotations, node=node, **fields)
    made["spec"]["containers"] = [spec(c) for c in devices if c not in init]  # none where none is given
    return made
