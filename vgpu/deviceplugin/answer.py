"""Contract 4's answer (docs/contracts.md) to one container's Allocate: environment, grant, mounts.

What ``Allocator`` (vgpu/deviceplugin/allocate.py) sends kubelet once it knows which pod and
container the device IDs serve: the region folder on the host (open to the container's
processes, under a parent only root reaches), the grant written where the container can only
read it, the environment of contract 4 (a copy the hook ignores under a grant), and the mounts
of the folder, the grant and the hook library.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from vgpu.core.annotations import SHARING_MPS, ContainerAllocation, DeviceAllocation
from vgpu.deviceplugin.api import api_pb2
from vgpu.hookabi.layout import GRANT_PATH_IN_CONTAINER, MPS_PIPE_IN_CONTAINER
from vgpu.node import folders, inject
from vgpu.node.config import NodeConfig
from vgpu.node.devices import DeviceState
from vgpu.node.driver import DriverFiles
from vgpu.node.grants import limits, write_grant_file
from vgpu.node.hooklib import HookInstall, hand_out
from vgpu.node.mig import MigDevice
from vgpu.node.paths import CONTAINER_HOOK_PATH, REGION_FILE_NAME, HostPaths


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
    and libraries (vgpu/node/driver.py), for nodes without NVIDIA's container toolkit.
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
            devices = [
                api_pb2.DeviceSpec(
                    container_path=d.container_path, host_path=d.host_path, permissions=d.permissions
                )
                for d in driver.devices(minors) + driver.caps(caps)
            ]
        except FileNotFoundError as err:
            raise PodFailure(
                f"driverInject is plugin but {err} of a card of container {container.name} is missing on "
                f"node {node}: load the NVIDIA driver's modules (nvidia-modprobe) or fix the node's /dev"
            ) from err
    inside = paths.container_dir_inside(pod_uid, container.name)
    host_dir = paths.container_dir(pod_uid, container.name)
    # The container's processes, whatever their user, create the region in their folder, so the
    # folder is open to all; its parent is closed (0700), so on the host only root reaches it; a
    # tmpfs of its own with containerFolder: tmpfs (vgpu/node/folders.py).
    folders.make(host_dir, config.container_folder)
    mps = mps_card(state, container, node)
    envs, grant = limits(shares, config, f"{inside}/{REGION_FILE_NAME}", priority, mps=mps is not None)
    record = write_grant_file(paths, host_dir.name, grant)
    # Which hook version the container gets, where it cannot reach: the version stays on the
    # host while the record does (vgpu/node/hooklib.py).
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
        mounts += [
            api_pb2.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
            for m in driver.mounts()
        ]
    uuids = [d.uuid for d in shares]
    cdi_devices: list[api_pb2.CDIDevice] = []
    if config.driver_inject == "runtime":  # NVIDIA's toolkit, by volume mounts (vgpu/node/inject.py)
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
