"""A container's grant and contract 4's environment, written on the host.

The device plugin's Allocate (vgpu/deviceplugin/answer.py) and the DRA plugin's prepare
(vgpu/dra/prepare.py) hold a container alike: the same environment, the same grant, written to
the same folder only root reaches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Protocol

from vgpu.hookabi.grant import Grant, write_grant
from vgpu.hookabi.layout import MPS_PIPE_IN_CONTAINER
from vgpu.hookabi.layout import SHARING_MPS as SHARING_MPS_GRANT
from vgpu.hookabi.layout import SHARING_TIMESLICE as SHARING_TIMESLICE_GRANT
from vgpu.node.config import NodeConfig
from vgpu.node.paths import HostPaths


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
