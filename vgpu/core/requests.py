"""What a pod asks for (contract 1, docs/contracts.md): parse a pod spec into per-container vGPU requests.

Input is the pod as the API server serialises it (a ``dict`` with camelCase keys). Values are
Kubernetes quantities: the API server rewrites ``nvidia.com/gpumem: 1000`` as ``"1k"``, so a
quantity is parsed exactly and must be a whole number.

Kubernetes runs init containers one after another before the app containers, so a pod needs, on
each card, the largest of what any one phase needs: each init container (with the restartable
"sidecar" init containers started before it), then all app containers with all sidecars. The
:class:`PodRequest` keeps that phase structure for the fit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from vgpu.core import annotations as ann
from vgpu.core.config import POLICIES, SchedulerConfig
from vgpu.core.errors import RequestError
from vgpu.core.mig import RESOURCE_PREFIX as MIG_PREFIX
from vgpu.core.mig import TABLES, profile_of_resource, resource_for
from vgpu.core.quantity import SOURCE, parse_quantity, shown, suffix_of
from vgpu.core.selection import KIND_MPS, Selection, hami_modes

RESOURCE_GPU = ann.GPU_RESOURCE  # the resource kubelet counts (contract 2 says it too)
RESOURCE_MEM = "nvidia.com/gpumem"
RESOURCE_MEM_PERCENT = "nvidia.com/gpumem-percentage"
RESOURCE_CORES = "nvidia.com/gpucores"
RESOURCE_PRIORITY = "nvidia.com/priority"
RESOURCES = (RESOURCE_GPU, RESOURCE_MEM, RESOURCE_MEM_PERCENT, RESOURCE_CORES, RESOURCE_PRIORITY)


# The most MiB one vGPU may ask for (nvidia.com/gpumem): 1 TiB. The largest cards made carry 288 GB
# (about 275,000 MiB), so this leaves room for a node's deviceMemoryScaling (oversubscription) of
# close to 4; a value past it is a unit mistake (bytes, or a memory suffix), never a request that a
# node could hold, and it would otherwise wait Pending for ever.
GPUMEM_MAX_MIB = 1 << 20
# Suffixes that make nvidia.com/gpumem a count of bytes in the writer's mind: every binary one, and
# the decimal ones from M up. Not "k": the API server itself writes a plain 3000 as "3k".
_MEMORY_SUFFIXES = frozenset(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "M", "G", "T", "P", "E"))


def gpumem_unit_mistake(raw: Any, mib: int) -> str | None:
    """Why ``nvidia.com/gpumem`` (``raw`` as written, ``mib`` as read) is a unit mistake, or None.

    Written with a memory suffix (``4Gi``) or past :data:`GPUMEM_MAX_MIB`: the message says what
    the writer most likely meant, reading the value as bytes (``4Gi`` -> 4096 MiB).
    """
    text = raw.strip() if isinstance(raw, str) else ""
    suffixed = bool(text) and suffix_of(text) in _MEMORY_SUFFIXES
    if not suffixed and mib <= GPUMEM_MAX_MIB:
        return None
    meant = max(1, -(-mib // (1 << 20)))  # bytes -> MiB, rounded up
    if suffixed:
        why = f"{shown(raw)} reads as {mib} MiB; write the MiB as a plain number"
    else:
        why = (
            f"{mib} MiB is more than any card has: at most {GPUMEM_MAX_MIB} MiB (1 TiB) per vGPU; "
            f"{mib} bytes are {meant} MiB"
        )
    return f"{RESOURCE_MEM} is in MiB: did you mean {meant}? ({why})"


@dataclass(frozen=True)
class ContainerRequest:
    """One container's vGPUs: ``count`` cards, each with the same share.

    Exactly one of ``memory_mib`` and ``memory_percent`` is set; ``memory_percent == 100`` is the
    whole card. ``cores`` is percent of a card (0 = no compute cap; 100 = the card exclusively).
    """

    name: str
    count: int
    memory_mib: int | None
    memory_percent: int | None
    cores: int
    priority: int = 1
    init: bool = False
    sidecar: bool = False
    resource: str = RESOURCE_GPU  # the kubelet resource its vGPUs come from (nvidia.com/mig-<profile>)

    def memory_on(self, card_memory_mib: int) -> int:
        if self.memory_mib is not None:
            return self.memory_mib
        assert self.memory_percent is not None
        return card_memory_mib * self.memory_percent // 100

    @property
    def exclusive(self) -> bool:
        return self.cores >= 100


@dataclass(frozen=True)
class PodRequest:
    """A pod's vGPU needs, in spec order (init containers first)."""

    containers: tuple[ContainerRequest, ...]
    selection: Selection = Selection()
    node_policy: str | None = None
    gpu_policy: str | None = None

    @cached_property
    def wants_vgpu(self) -> bool:
        return any(c.count > 0 for c in self.containers)

    @cached_property
    def resource(self) -> str:
        """The one resource the pod's vGPUs come from (parse_pod refuses two)."""
        return next((c.resource for c in self.containers if c.count > 0), RESOURCE_GPU)

    @cached_property
    def single_container(self) -> ContainerRequest | None:
        """The one container with vGPUs when no other container (init included) has any, else None."""
        found = None
        for c in self.containers:
            if c.count:
                if found is not None or c.init:
                    return None
                found = c
        return found

    def phases(self) -> list[list[ContainerRequest]]:
        """Groups of containers that hold their vGPUs at the same time (see the module doc)."""
        out: list[list[ContainerRequest]] = []
        sidecars: list[ContainerRequest] = []
        for c in self.containers:
            if c.init and not c.sidecar:
                out.append([*sidecars, c])
            elif c.sidecar:
                sidecars.append(c)
        apps = [c for c in self.containers if not c.init]
        out.append([*sidecars, *apps])
        return [[c for c in phase if c.count > 0] for phase in out if any(c.count > 0 for c in phase)]


def asks_for_vgpu(pod: Mapping[str, Any]) -> bool:
    """True when any container names one of our resources (cheap; no validation).

    The webhook asks this of every pod before anything checked its shape, so a part of the wrong
    type is passed over here, never an exception (parse_pod names it where it is called).
    """
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        return False
    for key in ("initContainers", "containers"):
        containers = spec.get(key)
        if not isinstance(containers, list):
            continue
        for c in containers:
            res = c.get("resources") if isinstance(c, dict) else None
            if not isinstance(res, dict):
                continue
            for part in ("limits", "requests"):
                values = res.get(part)
                if isinstance(values, dict) and any(
                    r in RESOURCES or (isinstance(r, str) and r.startswith(MIG_PREFIX)) for r in values
                ):
                    return True
    return False


def _resources(container: Mapping[str, Any], path: str) -> dict[str, tuple[Any, str]]:
    res = container.get("resources") or {}
    if not isinstance(res, dict):
        raise RequestError(SOURCE, f"{path}.resources", "must be an object")
    out: dict[str, tuple[Any, str]] = {}
    for part in ("requests", "limits"):  # limits win: extended resources live there
        values = res.get(part) or {}
        if not isinstance(values, dict):
            raise RequestError(SOURCE, f"{path}.resources.{part}", "must be an object")
        for name in values:
            if name in RESOURCES or (isinstance(name, str) and name.startswith(MIG_PREFIX)):
                out[name] = (values[name], f"{path}.resources.{part}[{name}]")
    return out


def _mig_request(
    name: str, values: dict[str, int], fields: dict[str, str], init: bool, sidecar: bool
) -> ContainerRequest:
    """A container asking for whole MIG devices of one profile (``nvidia.com/mig-<profile>``)."""
    migs = [k for k in values if k.startswith(MIG_PREFIX)]
    if len(migs) > 1:
        raise RequestError(
            SOURCE, fields[migs[1]], f"asks for a second MIG profile beside {migs[0]}: one a container"
        )
    resource = migs[0]
    profile = profile_of_resource(resource) or ""
    if not any(t.has(profile) for t in TABLES):
        known = ", ".join(sorted({resource_for(p.name) for t in TABLES for p in t.profiles}))
        raise RequestError(SOURCE, fields[resource], f"no MIG profile {profile!r} is known; known: {known}")
    others = [k for k in values if k not in (resource, RESOURCE_PRIORITY)]
    if others:
        raise RequestError(
            SOURCE,
            fields[others[0]],
            f"a MIG device is whole: give {resource} alone (its memory and compute are the profile's)",
        )
    priority = values.get(RESOURCE_PRIORITY, 1)
    if priority not in (0, 1):
        raise RequestError(
            SOURCE, fields[RESOURCE_PRIORITY], f"must be 0 (high) or 1 (normal), got {priority}"
        )
    count = values[resource]
    if count == 0:
        return ContainerRequest(name, 0, 0, None, 0, 1, init, sidecar)
    return ContainerRequest(name, count, None, 100, 100, priority, init, sidecar, resource)


def parse_container(
    container: Mapping[str, Any], path: str, config: SchedulerConfig, init: bool = False
) -> ContainerRequest:
    """Parse one container; raises RequestError naming the field for a request that can never fit."""
    name = container.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(SOURCE, f"{path}.name", "must be a non-empty string")
    sidecar = init and container.get("restartPolicy") == "Always"
    res = _resources(container, path)
    values = {k: parse_quantity(v, f) for k, (v, f) in res.items()}
    fields = {k: f for k, (_, f) in res.items()}
    for k, v in values.items():
        if v < 0:
            raise RequestError(SOURCE, fields[k], f"must not be negative, got {v}")
    if RESOURCE_MEM in values:
        mistake = gpumem_unit_mistake(res[RESOURCE_MEM][0], values[RESOURCE_MEM])
        if mistake:
            raise RequestError(SOURCE, fields[RESOURCE_MEM], mistake)
    if not values:
        return ContainerRequest(name, 0, 0, None, 0, 1, init, sidecar)
    if any(k.startswith(MIG_PREFIX) for k in values):
        return _mig_request(name, values, fields, init, sidecar)
    # gpumem 0 is read as HAMi reads it: as not given (defaultMem, else the whole card's memory),
    # so it is booked and granted as that, never as a grant of 0 MiB, which the hook reads as no limit
    mem: int | None = values.get(RESOURCE_MEM) or None
    if mem is not None and RESOURCE_MEM_PERCENT in values:
        raise RequestError(
            SOURCE,
            fields[RESOURCE_MEM_PERCENT],
            f"give either {RESOURCE_MEM} (MiB) or {RESOURCE_MEM_PERCENT} (percent), not both",
        )
    count = values.get(RESOURCE_GPU, 1)
    if count == 0:
        others = [k for k in values if k not in (RESOURCE_GPU, RESOURCE_PRIORITY) and values[k] > 0]
        if others:
            raise RequestError(
                SOURCE,
                fields[RESOURCE_GPU],
                f"is 0 but {others[0]} is set; ask for at least one vGPU or drop it",
            )
        return ContainerRequest(name, 0, 0, None, 0, 1, init, sidecar)
    percent = values.get(RESOURCE_MEM_PERCENT)
    if percent is not None and not 1 <= percent <= 100:
        raise RequestError(
            SOURCE, fields[RESOURCE_MEM_PERCENT], f"must be 1..100 (percent of a card), got {percent}"
        )
    if mem is None and percent is None:
        if config.default_mem > 0:
            mem = config.default_mem
        else:
            percent = 100
    cores = values.get(RESOURCE_CORES, config.default_cores)
    if cores > 100:
        raise RequestError(
            SOURCE,
            fields[RESOURCE_CORES],
            f"must be 0..100 (percent of a card; 100 = exclusive), got {cores}",
        )
    priority = values.get(RESOURCE_PRIORITY, 1)
    if priority not in (0, 1):
        raise RequestError(
            SOURCE, fields[RESOURCE_PRIORITY], f"must be 0 (high) or 1 (normal), got {priority}"
        )
    return ContainerRequest(
        name, count, mem, percent if mem is None else None, cores, priority, init, sidecar
    )


def _csv(value: Any) -> tuple[str, ...]:
    if not isinstance(value, str):
        return ()
    return tuple(p.strip() for p in value.split(",") if p.strip())


def parse_pod(pod: Mapping[str, Any], config: SchedulerConfig) -> PodRequest:
    """Parse a whole pod; raises RequestError naming the field (``spec.containers[1]...``)."""
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        raise RequestError(SOURCE, "spec", "missing or not an object")
    containers: list[ContainerRequest] = []
    paths: list[str] = []
    for key, init in (("initContainers", True), ("containers", False)):
        items = spec.get(key) or []
        if not isinstance(items, list):
            raise RequestError(SOURCE, f"spec.{key}", "must be a list")
        for i, c in enumerate(items):
            path = f"spec.{key}[{i}]"
            if not isinstance(c, dict):
                raise RequestError(SOURCE, path, "must be an object")
            containers.append(parse_container(c, path, config, init=init))
            paths.append(path)
            first = next((x for x in containers if x.count), None)
            if first is not None and containers[-1].count and containers[-1].resource != first.resource:
                raise RequestError(
                    SOURCE,
                    f"{path}.resources",
                    f"asks for {containers[-1].resource} but container {first.name} for {first.resource}: "
                    "a pod's vGPUs come from one resource",
                )
    meta = pod.get("metadata") or {}
    if not isinstance(meta, dict):
        raise RequestError(SOURCE, "metadata", "must be an object")
    annos = meta.get("annotations") or {}
    if not isinstance(annos, dict):
        raise RequestError(SOURCE, "metadata.annotations", "must be an object")
    policies: dict[str, str | None] = {}
    for key, hami in (
        (ann.NODE_POLICY_ANNOTATION, ann.HAMI_NODE_POLICY_ANNOTATION),
        (ann.GPU_POLICY_ANNOTATION, ann.HAMI_GPU_POLICY_ANNOTATION),
    ):
        policies[key] = _policy(annos, key, hami)
    selection = Selection(
        kinds=_one_card_under_mps(hami_modes(annos), containers, paths),
        use_types=_csv(annos.get(ann.USE_GPUTYPE_ANNOTATION)),
        nouse_types=_csv(annos.get(ann.NOUSE_GPUTYPE_ANNOTATION)),
        use_uuids=_csv(annos.get(ann.USE_GPUUUID_ANNOTATION)),
        nouse_uuids=_csv(annos.get(ann.NOUSE_GPUUUID_ANNOTATION)),
    )
    return PodRequest(
        containers=tuple(containers),
        selection=selection,
        node_policy=policies[ann.NODE_POLICY_ANNOTATION],
        gpu_policy=policies[ann.GPU_POLICY_ANNOTATION],
    )


def _field_of(key: str) -> str:
    return f"metadata.annotations[{key}]"


def _policy(annos: Mapping[str, Any], key: str, hami: str) -> str | None:
    """A policy annotation, ours or HAMi's spelling of it (same values; HAMi trims spaces)."""
    value = annos.get(key)
    if value is not None and value not in POLICIES:
        raise RequestError(
            SOURCE, _field_of(key), f"must be one of {', '.join(POLICIES)}, got {shown(value)}"
        )
    theirs = annos.get(hami)
    if theirs is None:
        return value
    if not isinstance(theirs, str) or theirs.strip() not in POLICIES:
        hint = ""
        if hami == ann.HAMI_GPU_POLICY_ANNOTATION:
            hint = (
                " (HAMi's topology-aware, numa and mutex are not offered: a container of several vGPUs"
                " always gets NVLink-joined cards first, then cards on one NUMA node; gpucores: 100"
                " holds a card alone)"
            )
        raise RequestError(
            SOURCE, _field_of(hami), f"must be one of {', '.join(POLICIES)}, got {shown(theirs)}{hint}"
        )
    if value is not None and value != theirs.strip():
        raise RequestError(
            SOURCE, _field_of(hami), f"is {theirs.strip()!r} but {key} is {value!r}: give one of them"
        )
    return theirs.strip()


def _one_card_under_mps(
    kinds: frozenset[str], containers: list[ContainerRequest], paths: list[str]
) -> frozenset[str]:
    """``kinds``; refused where the pod takes only MPS cards and a container asks for more than
    one: a process talks to one MPS daemon (one card's pipe), so no node could ever serve it."""
    if kinds != {KIND_MPS}:
        return kinds
    for c, path in zip(containers, paths, strict=True):
        if c.count > 1 and c.resource == RESOURCE_GPU:
            raise RequestError(
                SOURCE,
                f"{path}.resources.limits[{RESOURCE_GPU}]",
                f"is {c.count}, but {ann.HAMI_VGPU_MODE_ANNOTATION} mps gives a container one card "
                f"(a process talks to one card's MPS daemon): set {RESOURCE_GPU} to 1, or split the "
                "work over containers of one card each (docs/mps.md)",
            )
    return kinds
