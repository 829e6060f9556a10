"""Codecs of the annotations that carry state between the parts (contracts 2 and 3, docs/contracts.md).

Two versioned JSON documents, each with one ``encode_*`` and one ``decode_*`` function:

* the node inventory, ``vgpu.openaios.io/devices`` on a Node, written by the device plugin::

    {"version": 1, "devices": [{"uuid": "GPU-...", "index": 0, "model": "NVIDIA H200",
      "memoryMiB": 143771, "cores": 100, "split": 10, "numa": 0, "healthy": true,
      "links": {"GPU-...": "nvlink"}}]}

* the placement, ``vgpu.openaios.io/allocation`` on a Pod, written by the extender at bind::

    {"version": 1, "node": "node-a", "containers": [{"name": "main",
      "devices": [{"uuid": "GPU-...", "memoryMiB": 3000, "cores": 30}]}]}

  together with ``vgpu.openaios.io/phase`` (``bound`` -> ``allocated`` | ``failed``) and
  ``vgpu.openaios.io/reason``.

Decoding checks the version and every field, and raises :class:`vgpu.core.errors.AnnotationError`
naming the annotation and the field (``devices[1].memoryMiB``). Encoding is deterministic (sorted
keys, no spaces), so a writer can compare strings to see whether anything changed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vgpu.core.errors import AnnotationError
from vgpu.core.fields import FieldReader as _Reader

PREFIX = "vgpu.openaios.io/"

# contract 2 (docs/contracts.md): node inventory
DEVICES_ANNOTATION = PREFIX + "devices"
DEVICES_VERSION = 1
# version 2: a device may be a MIG device (``mig``), offered as another resource (``resource``),
# or, under migStrategy: dynamic, a card cut on demand (``migDynamic``); written only by a node
# that has such a device, so an older reader refuses that node alone
DEVICES_VERSION_MIG = 2
GPU_RESOURCE = "nvidia.com/gpu"
# how a shared card's containers share it (``sharing``, version 2 only where MPS): time-sliced under
# the hook, or spatially through the card's MPS daemon (docs/mps.md); a card never mixes the two
SHARING_TIMESLICE = "timeslice"
SHARING_MPS = "mps"
SHARING_MODES = (SHARING_TIMESLICE, SHARING_MPS)

# contract 3 (docs/contracts.md): placement
ALLOCATION_ANNOTATION = PREFIX + "allocation"
ALLOCATION_VERSION = 1
PHASE_ANNOTATION = PREFIX + "phase"
REASON_ANNOTATION = PREFIX + "reason"
PHASE_BOUND = "bound"
PHASE_ALLOCATED = "allocated"
PHASE_FAILED = "failed"
PHASES = (PHASE_BOUND, PHASE_ALLOCATED, PHASE_FAILED)
# written by the extender on a pod it refused for lack of room once room frees (when, RFC 3339):
# the pod's own update makes kube-scheduler retry it (see vgpu.extender.state.NUDGE_WINDOW_S)
ROOM_FREED_ANNOTATION = PREFIX + "room-freed"
# On the node's Lease, renewed with it: device memory each container holds, from its region,
# {"<pod-uid>_<container>": {"<gpu uuid>": bytes}} (vgpu status shows it).
USAGE_ANNOTATION = PREFIX + "usage"
# also on the Lease (contract 2): per container folder, the lines that hold its device memory
# (["hook", "driver-cap", "node"]) and its media engines' use per card ({uuid: {"dec": 12, ...}})
LINES_ANNOTATION = PREFIX + "memory-lines"
CODEC_ANNOTATION = PREFIX + "codec"

# contract 1 (docs/contracts.md): what a user may write on a pod
USE_GPUTYPE_ANNOTATION = "nvidia.com/use-gputype"
NOUSE_GPUTYPE_ANNOTATION = "nvidia.com/nouse-gputype"
USE_GPUUUID_ANNOTATION = "nvidia.com/use-gpuuuid"
NOUSE_GPUUUID_ANNOTATION = "nvidia.com/nouse-gpuuuid"
NODE_POLICY_ANNOTATION = PREFIX + "node-policy"
GPU_POLICY_ANNOTATION = PREFIX + "gpu-policy"
# HAMi's spellings, read where the meaning is ours (see vgpu.core.requests.parse_pod): the four
# selection annotations above are HAMi's names already.
HAMI_NODE_POLICY_ANNOTATION = "hami.io/node-scheduler-policy"
HAMI_GPU_POLICY_ANNOTATION = "hami.io/gpu-scheduler-policy"
HAMI_VGPU_MODE_ANNOTATION = "nvidia.com/vgpu-mode"  # hami-core, mig, mps: vgpu/core/selection.py
HAMI_NUMA_BIND_ANNOTATION = "nvidia.com/numa-bind"  # "true" (a hard rule) is refused: not offered

# contract 2 (docs/contracts.md): liveness Lease of a node's device plugin
LEASE_PREFIX = "vgpu-"
LEASE_HOLDER_PREFIX = "vgpu-device-plugin/"  # + the node's name: the Lease's holderIdentity


def lease_name(node: str) -> str:
    """Name of the Lease the device plugin of ``node`` renews."""
    return LEASE_PREFIX + node


# ---------------------------------------------------------------------------------------------
# contract 2 (docs/contracts.md): node inventory


@dataclass(frozen=True)
class MigSlice:
    """Where a MIG device sits: its card, its profile and its memory slices (start, size)."""

    parent: str
    profile: str
    start: int
    size: int


@dataclass(frozen=True)
class MigInstance:
    """A GPU instance on a card cut on demand: its profile, memory slices and the pod whose
    allocation names it (``""``: none, a leftover the node reclaims)."""

    profile: str
    start: int
    size: int
    pod: str = ""


@dataclass(frozen=True)
class MigDynamic:
    """A card in MIG mode that the node cuts on demand (``migStrategy: dynamic``): the profile
    table it follows (:data:`vgpu.core.mig.TABLES`' ``product``) and the instances it holds."""

    table: str
    instances: tuple[MigInstance, ...] = ()


@dataclass(frozen=True)
class Device:
    """One physical GPU (or one MIG device) as the device plugin advertises it.

    ``memory_mib`` and ``cores`` already include the node's memory and core scaling; ``split`` is
    the most vGPUs the card may carry; ``numa`` is the NUMA node (-1 when unknown); ``links`` maps
    a peer card's UUID to the kind of link between them (``nvlink``, ``pcie``...). ``resource``
    is the kubelet resource the device is offered as, and ``mig`` says where a MIG device sits
    (a MIG device is whole: ``split`` 1, ``cores`` 100).
    """

    uuid: str
    index: int
    model: str
    memory_mib: int
    cores: int
    split: int
    numa: int = -1
    healthy: bool = True
    links: Mapping[str, str] = field(default_factory=dict)
    resource: str = GPU_RESOURCE
    mig: MigSlice | None = None
    mig_dynamic: MigDynamic | None = None  # cut into MIG instances on demand (docs/mig.md)
    sharing: str = SHARING_TIMESLICE  # SHARING_MPS: the card's containers are its MPS daemon's clients


@dataclass(frozen=True)
class NodeInventory:
    devices: tuple[Device, ...]
    version: int = DEVICES_VERSION

    def offering(self, resource: str) -> NodeInventory:
        """The devices offered as ``resource`` (the same object when all are, and for a second
        call with the same resource, so callers may compare by identity)."""
        memo: dict[str, NodeInventory] = self.__dict__.setdefault("_offering", {})
        found = memo.get(resource)  # asked per candidate node in filter: one dict look-up
        if found is None:
            if all(d.resource == resource for d in self.devices):
                found = memo[resource] = self
            else:
                offered = tuple(d for d in self.devices if d.resource == resource)
                found = memo[resource] = NodeInventory(offered)
        return found


def _encode_device(d: Device) -> dict[str, Any]:
    out: dict[str, Any] = {
        "uuid": d.uuid,
        "index": d.index,
        "model": d.model,
        "memoryMiB": d.memory_mib,
        "cores": d.cores,
        "split": d.split,
        "numa": d.numa,
        "healthy": d.healthy,
        "links": dict(d.links),
    }
    if d.resource != GPU_RESOURCE:
        out["resource"] = d.resource
    if d.mig is not None:
        out["mig"] = {
            "parent": d.mig.parent,
            "profile": d.mig.profile,
            "start": d.mig.start,
            "size": d.mig.size,
        }
    out.update(_encode_dynamic(d.mig_dynamic))
    if d.sharing != SHARING_TIMESLICE:
        out["sharing"] = d.sharing
    return out


def encode_devices(inventory: NodeInventory) -> str:
    """Version 1, or 2 when a device is a MIG device, offered as another resource or cut on demand."""
    mig = any(
        d.mig is not None
        or d.resource != GPU_RESOURCE
        or d.mig_dynamic is not None
        or d.sharing != SHARING_TIMESLICE
        for d in inventory.devices
    )
    doc = {
        "version": DEVICES_VERSION_MIG if mig else DEVICES_VERSION,
        "devices": [_encode_device(d) for d in inventory.devices],
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def _encode_dynamic(m: MigDynamic | None) -> dict[str, Any]:
    if m is None:
        return {}
    instances = [{"profile": i.profile, "start": i.start, "size": i.size, "pod": i.pod} for i in m.instances]
    return {"migDynamic": {"table": m.table, "instances": instances}}


def _decode_dynamic(r: _Reader, obj: Mapping[str, Any], path: str) -> MigDynamic:
    where = f"{path}.migDynamic"
    m = r.obj(obj["migDynamic"], where)
    instances = []
    for k, item in enumerate(r.array(m, "instances", f"{where}.instances")):
        ipath = f"{where}.instances[{k}]"
        i = r.obj(item, ipath)
        instances.append(
            MigInstance(
                profile=r.string(i, "profile", ipath),
                start=r.integer(i, "start", ipath, minimum=0),
                size=r.integer(i, "size", ipath, minimum=1),
                pod=r.string(i, "pod", ipath, allow_empty=True),
            )
        )
    return MigDynamic(table=r.string(m, "table", where), instances=tuple(instances))


def decode_devices(text: str | bytes | None) -> NodeInventory:
    """Decode a node's ``vgpu.openaios.io/devices`` annotation; raises AnnotationError."""
    r = _Reader(DEVICES_ANNOTATION)
    doc = r.load(text)
    r.version(doc, DEVICES_VERSION, DEVICES_VERSION_MIG)
    v2 = doc["version"] == DEVICES_VERSION_MIG
    items = r.array(doc, "devices", "devices")
    devices: list[Device] = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        path = f"devices[{i}]"
        obj = r.obj(item, path)
        uuid = r.string(obj, "uuid", path)
        if uuid in seen:
            raise AnnotationError(DEVICES_ANNOTATION, f"{path}.uuid", f"duplicate uuid {uuid!r}")
        seen.add(uuid)
        numa_raw = obj.get("numa", -1)
        links_raw = obj.get("links", {})
        if not isinstance(links_raw, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in links_raw.items()
        ):
            raise AnnotationError(
                DEVICES_ANNOTATION, f"{path}.links", "must be an object mapping peer uuid to link kind"
            )
        devices.append(
            Device(
                uuid=uuid,
                index=r.integer(obj, "index", path, minimum=0),
                model=r.string(obj, "model", path, allow_empty=True),
                memory_mib=r.integer(obj, "memoryMiB", path, minimum=0),
                cores=r.integer(obj, "cores", path, minimum=0),
                split=r.integer(obj, "split", path, minimum=1),
                numa=-1 if numa_raw is None else r.integer(obj, "numa", path, minimum=-1),
                healthy=r.boolean(obj, "healthy", path),
                links=dict(links_raw),
                resource=r.string(obj, "resource", path) if v2 and "resource" in obj else GPU_RESOURCE,
                mig=_decode_mig(r, obj, path) if v2 and "mig" in obj else None,
                mig_dynamic=_decode_dynamic(r, obj, path) if v2 and "migDynamic" in obj else None,
                sharing=_decode_sharing(r, obj, path) if v2 and "sharing" in obj else SHARING_TIMESLICE,
            )
        )
    return NodeInventory(devices=tuple(devices))


def _decode_sharing(r: _Reader, obj: Mapping[str, Any], path: str) -> str:
    value = r.string(obj, "sharing", path)
    if value not in SHARING_MODES:
        raise AnnotationError(
            DEVICES_ANNOTATION, f"{path}.sharing", f"is {value!r}, not one of {', '.join(SHARING_MODES)}"
        )
    return value


def _decode_mig(r: _Reader, obj: Mapping[str, Any], path: str) -> MigSlice:
    m = r.obj(obj["mig"], f"{path}.mig")
    where = f"{path}.mig"
    return MigSlice(
        parent=r.string(m, "parent", where),
        profile=r.string(m, "profile", where),
        start=r.integer(m, "start", where, minimum=0),
        size=r.integer(m, "size", where, minimum=1),
    )


# ---------------------------------------------------------------------------------------------
# contract 3 (docs/contracts.md): placement


@dataclass(frozen=True)
class MigGrant:
    """The MIG instance the node creates for one vGPU on a card cut on demand: its profile and
    its first memory slice (the size is the profile's)."""

    profile: str
    start: int


@dataclass(frozen=True)
class DeviceAllocation:
    """The share of one card that one vGPU of a container holds; ``mig``: as a MIG instance
    made on demand (migStrategy: dynamic), ``memory_mib`` and ``cores`` then being what the pod
    asked."""

    uuid: str
    memory_mib: int
    cores: int
    mig: MigGrant | None = None


@dataclass(frozen=True)
class ContainerAllocation:
    name: str
    devices: tuple[DeviceAllocation, ...]


@dataclass(frozen=True)
class Allocation:
    """Where a pod's vGPUs went: init containers first, then containers, each in spec order.

    Containers that ask for no vGPU are left out.
    """

    node: str
    containers: tuple[ContainerAllocation, ...]
    version: int = ALLOCATION_VERSION

    def container(self, name: str) -> ContainerAllocation | None:
        return next((c for c in self.containers if c.name == name), None)


def encode_allocation(allocation: Allocation) -> str:
    doc = {
        "version": ALLOCATION_VERSION,
        "node": allocation.node,
        "containers": [
            {
                "name": c.name,
                "devices": [_encode_share(d) for d in c.devices],
            }
            for c in allocation.containers
        ],
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def _encode_share(d: DeviceAllocation) -> dict[str, Any]:
    out: dict[str, Any] = {"uuid": d.uuid, "memoryMiB": d.memory_mib, "cores": d.cores}
    if d.mig is not None:  # added within version 1: a reader that does not know it passes over it
        out["mig"] = {"profile": d.mig.profile, "start": d.mig.start}
    return out


def _decode_grant(r: _Reader, dobj: Mapping[str, Any], dpath: str) -> MigGrant | None:
    if "mig" not in dobj:
        return None
    m = r.obj(dobj["mig"], f"{dpath}.mig")
    return MigGrant(r.string(m, "profile", f"{dpath}.mig"), r.integer(m, "start", f"{dpath}.mig", minimum=0))


def decode_allocation(text: str | bytes | None) -> Allocation:
    """Decode a pod's ``vgpu.openaios.io/allocation`` annotation; raises AnnotationError."""
    r = _Reader(ALLOCATION_ANNOTATION)
    doc = r.load(text)
    r.version(doc, ALLOCATION_VERSION)
    node = r.string(doc, "node", "")
    containers: list[ContainerAllocation] = []
    for i, item in enumerate(r.array(doc, "containers", "containers")):
        path = f"containers[{i}]"
        obj = r.obj(item, path)
        name = r.string(obj, "name", path)
        devs: list[DeviceAllocation] = []
        for j, ditem in enumerate(r.array(obj, "devices", f"{path}.devices")):
            dpath = f"{path}.devices[{j}]"
            dobj = r.obj(ditem, dpath)
            devs.append(
                DeviceAllocation(
                    uuid=r.string(dobj, "uuid", dpath),
                    memory_mib=r.integer(dobj, "memoryMiB", dpath, minimum=0),
                    cores=r.integer(dobj, "cores", dpath, minimum=0),
                    mig=_decode_grant(r, dobj, dpath),
                )
            )
        containers.append(ContainerAllocation(name=name, devices=tuple(devs)))
    return Allocation(node=node, containers=tuple(containers))
