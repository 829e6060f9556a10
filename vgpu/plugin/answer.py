"""Contract 4's answer (docs/contracts.md) to one container's Allocate: environment, grant, mounts.

What ``Allocator`` (vgpu/plugin/allocate.py) sends kubelet once it knows which pod and
container the device IDs serve: the region folder on the host (open to the container's
processes, under a parent only root reaches), the grant written where the container can only
read it, the environment of contract 4 (a copy the hook ignores under a grant), and the mounts
of the folder, the grant and the hook library.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Protocol

from vgpu.core.annotations import SHARING_MPS, ContainerAllocation, DeviceAllocation
from vgpu.hookabi.grant import Grant, write_grant
from vgpu.hookabi.layout import GRANT_PATH_IN_CONTAINER, MPS_PIPE_IN_CONTAINER
from vgpu.hookabi.layout import SHARING_MPS as SHARING_MPS_GRANT
from vgpu.hookabi.layout import SHARING_TIMESLICE as SHARING_TIMESLICE_GRANT
from vgpu.plugin import folders, inject
from vgpu.plugin.api import api_pb2
from vgpu.plugin.config import NodeConfig
from vgpu.plugin.devices import DeviceState
from vgpu.plugin.driver import DriverFiles
from vgpu.plugin.hooklib import HookInstall, hand_out
from vgpu.plugin.mig import MigDevice
from vgpu.plugin.paths import CONTAINER_HOOK_PATH, REGION_FILE_NAME, HostPaths


class PodFailure(Exception):
    """The pod cannot be served on this node; it is marked failed with this reason."""


def container_response(
    state: DeviceState,
    config: NodeConfig,
    paths: HostPaths,
    hook: HookInstall | None,
    node: str,
    pod_uid: str,
    container: ContainerAllocation,
    priority: str,
    driver: DriverFiles | None = None,
    made: Mapping[str, MigDevice] | None = None,
) -> api_pb2.ContainerAllocateResponse:
    """The answer for ``container`` of pod ``pod_uid`` (its grant written on the host); raises
    ``PodFailure`` for a card that is gone or unhealthy, ``OSError`` for a host folder.

    With ``driver`` (``driverInject: plugin``) the answer also carries the driver's device nodes
    and libraries (vgpu/plugin/driver.py), for nodes without NVIDIA's container toolkit.
    ``made``: the MIG devices made on demand for the container's vGPUs, by card (migdynamic.py)."""
    minors: list[int] = []
    caps: list[int] = []  # a MIG device's GI and CI access files (/dev/nvidia-caps/nvidia-cap<N>)
    shares: list[DeviceAllocation] = []
    for d in container.devices:
        card = state.card(d.uuid)
        if card is None:
            raise PodFailure(f"card {d.uuid} of container {container.name} is not on node {node}")
        if not card.healthy:
            raise PodFailure(f"card {d.uuid} of container {container.name} is unhealthy")
        minor = card.minor if card.minor >= 0 else card.index
        minors += [minor] if minor not in minors else []
        mig = state.mig_device(d.uuid)
        made_here = (made or {}).get(d.uuid)
        if mig is not None:  # a static MIG device is whole: its limit is the slice's memory
            caps += [m for m in (mig.gi_minor, mig.ci_minor) if m >= 0]
            d = replace(d, memory_mib=card.memory_mib, cores=100)
        elif made_here is not None:  # made on demand: the memory asked within its own; its SMs are the cap
            caps += [n for n in (made_here.gi_minor, made_here.ci_minor) if n >= 0]
            d = replace(
                d, uuid=made_here.uuid, memory_mib=min(d.memory_mib, made_here.memory_mib), cores=0, mig=None
            )
        shares.append(d)
    devices: list[api_pb2.DeviceSpec] = []
    if driver is not None:
        try:
            devices = driver.devices(minors) + driver.caps(caps)
        except FileNotFoundError as err:
            raise PodFailure(
                f"driverInject is plugin but {err} of a card of container {container.name} is missing on "
                f"node {node}: load the NVIDIA driver's modules (nvidia-modprobe) or fix the node's /dev"
            ) from err
    inside = paths.container_dir_inside(pod_uid, container.name)
    host_dir = paths.container_dir(pod_uid, container.name)
    # The container's processes, whatever their user, create the region in their folder, so the
    # folder is open to all; its parent is closed (0700), so on the host only root reaches it; a
    # tmpfs of its own with containerFolder: tmpfs (vgpu/plugin/folders.py).
    folders.make(host_dir, config.container_folder)
    mps = mps_card(state, container, node)
    envs, grant = limits(shares, config, f"{inside}/{REGION_FILE_NAME}", priority, mps=mps is not None)
    record = write_grant_file(paths, host_dir.name, grant)
    # Which hook version the container gets, where it cannot reach: the version stays on the
    # host while the record does (vgpu/plugin/hooklib.py).
    hand_out(paths, host_dir.name, hook)
    mounts = [
        api_pb2.Mount(container_path=inside, host_path=str(host_dir), read_only=False),
        api_pb2.Mount(container_path=GRANT_PATH_IN_CONTAINER, host_path=str(record), read_only=True),
    ]
    if hook is not None:
        mounts += [
            api_pb2.Mount(container_path=CONTAINER_HOOK_PATH, host_path=str(hook.library), read_only=True),
            api_pb2.Mount(container_path="/etc/ld.so.preload", host_path=str(hook.preload), read_only=True),
        ]
    if mps is not None:  # the card's MPS daemon's pipe folder, read-only (the hook enforces its use)
        mounts.append(
            api_pb2.Mount(
                container_path=MPS_PIPE_IN_CONTAINER, host_path=str(paths.mps_pipe(mps)), read_only=True
            )
        )
    if driver is not None:
        mounts += driver.mounts()
    uuids = [d.uuid for d in shares]
    cdi_devices: list[api_pb2.CDIDevice] = []
    if config.driver_inject == "runtime":  # NVIDIA's toolkit, by volume mounts (vgpu/plugin/inject.py)
        mounts += [
            api_pb2.Mount(container_path=c, host_path=h, read_only=True)
            for c, h in inject.volume_mounts(uuids)
        ]
    elif config.driver_inject == "cdi":
        cdi_devices = [api_pb2.CDIDevice(name=n) for n in inject.cdi_names(config.cdi_kind, uuids)]
    return api_pb2.ContainerAllocateResponse(
        envs=envs, mounts=mounts, devices=devices, cdi_devices=cdi_devices
    )


def mps_card(state: DeviceState, container: ContainerAllocation, node: str) -> str | None:
    """The MPS card of ``container`` (None: its cards are time-sliced); ``PodFailure`` for a
    placement MPS cannot serve: more than one card, or MPS and time-sliced cards mixed."""
    on_mps = []
    for d in container.devices:
        card = state.card(d.uuid)
        whole = card is not None and state.mig_device(d.uuid) is None
        if card is not None and whole and state.offered(card).sharing == SHARING_MPS:
            on_mps.append(d.uuid)
    if not on_mps:
        return None
    if len(container.devices) != 1:
        raise PodFailure(
            f"container {container.name} is placed on {len(container.devices)} cards, {len(on_mps)} of them "
            f"in MPS mode on node {node}: an MPS container gets one card (one process talks to one MPS "
            "daemon); ask nvidia.com/gpu: 1 with nvidia.com/vgpu-mode: mps (docs/mps.md)"
        )
    return on_mps[0]


def write_grant_file(paths: HostPaths, folder_name: str, grant: Grant) -> Path:
    """The container's grant on the host, in a folder only root reaches (the arbiter, the
    monitor and ``vgpu limits`` read it there); the file itself is 0644 for the read-only mount."""
    grants = paths.grants_dir
    grants.mkdir(parents=True, exist_ok=True)
    grants.chmod(0o700)
    record = paths.grant(folder_name)
    write_grant(record, grant)
    return record


class Share(Protocol):
    """One card of a container's grant: contract 3's ``DeviceAllocation``, or a DRA claim's result."""

    @property
    def uuid(self) -> str: ...

    @property
    def memory_mib(self) -> int: ...

    @property
    def cores(self) -> int: ...


def limits(
    devices: Sequence[Share], config: NodeConfig, region_path: str, priority: str, mps: bool = False
) -> tuple[dict[str, str], Grant]:
    """Contract 4's environment and the grant for a container holding ``devices`` (the device
    plugin's Allocate and the DRA plugin's prepared claims hold a container alike).

    ``mps``: the card runs an MPS daemon (docs/mps.md): the grant makes the container its client
    through :data:`MPS_PIPE_IN_CONTAINER`, its cores the active thread percentage; the MPS
    variables here are a convenience, the hook sets them from the grant before cuInit."""
    envs = {
        "NVIDIA_VISIBLE_DEVICES": ",".join(d.uuid for d in devices),
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": region_path,
        "CUDA_TASK_PRIORITY": priority,
    }
    scaling = Fraction(repr(config.device_memory_scaling))  # 1.2 as 6/5, exactly: no 2499.999
    spill = config.oversubscribe and scaling > 1
    for i, d in enumerate(devices):
        envs[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] = f"{d.memory_mib}m"
        envs[f"CUDA_DEVICE_SM_LIMIT_{i}"] = str(min(d.cores, 100))
        if spill:
            # The card's share of the (scaled-up) grant stays on the card; the rest spills.
            envs[f"CUDA_DEVICE_MEMORY_BUDGET_{i}"] = f"{math.floor(d.memory_mib / scaling)}m"
    if config.oversubscribe:
        envs["CUDA_OVERSUBSCRIBE"] = "true"
    envs["CUDA_SM_POLICY"] = config.sm_policy
    if mps:
        envs["CUDA_MPS_PIPE_DIRECTORY"] = MPS_PIPE_IN_CONTAINER
        threads = min(devices[0].cores, 100) if devices else 0
        if threads > 0:  # 0: no thread cap, the daemon's default (every SM)
            envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(threads)
        envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(
            f"{i}={d.memory_mib}M" for i, d in enumerate(devices)
        )
    # The limits themselves go where the container can only read them: the hook takes them
    # from the grant at GRANT_PATH_IN_CONTAINER and ignores the environment's copy above.
    grant = Grant(
        uuids=tuple(d.uuid for d in devices),
        limits=tuple(d.memory_mib << 20 for d in devices),
        sm_limits=tuple(min(d.cores, 100) for d in devices),
        budgets=tuple(math.floor(d.memory_mib / scaling) << 20 if spill else 0 for d in devices),
        priority=int(priority),
        sm_policy=1 if config.sm_policy == "elastic" else 0,
        oversubscribe=config.oversubscribe,
        region_path=region_path,
        sharing=SHARING_MPS_GRANT if mps else SHARING_TIMESLICE_GRANT,
        mps_pipe=MPS_PIPE_IN_CONTAINER if mps else "",
    )
    return envs, grant
