"""The per-node settings of the device plugin, validated before anything starts.

The file (``--config``; every key optional)::

    split: 10                  # most vGPUs one card may carry (kubelet sees split x cards devices)
    deviceMemoryScaling: 1.0   # advertised memory = real memory x this; > 1 needs oversubscribe
    deviceCoreScaling: 1.0     # advertised cores = 100 x this
    oversubscribe: false       # spill device memory beyond the card to host RAM (CUDA_OVERSUBSCRIBE)
    smPolicy: cap              # cap: hold every container to its SM share; elastic: a container alone
                               # on its card may use idle SMs past its share (CUDA_SM_POLICY)
    resourceName: nvidia.com/gpu
    defaultMem: 0              # the scheduler's defaultMem and defaultCores (the chart sets both from
    defaultCores: 0            # one value): the node re-derives each pod's request as the scheduler did
    containerFolder: directory # tmpfs: each container's writable region folder is a small tmpfs of
                               # its own, nosuid,nodev,noexec (the chart's default; needs CAP_SYS_ADMIN)
    driverInject: runtime      # how a container gets its cards, never from its own environment:
                               # plugin: Allocate hands it the cards' device nodes and the driver's
                               # libraries itself; cdi: Allocate names CDI devices <cdiKind>=<uuid>
                               # of the node's CDI spec; runtime: NVIDIA's toolkit, told the cards by
                               # volume mounts (/var/run/nvidia-container-devices/<uuid>)
    cdiKind: nvidia.com/gpu    # the CDI kind of the node's spec (driverInject: cdi)
    migStrategy: none          # cards in MIG mode (docs/mig.md): none (offer the card, as before),
                               # single (each MIG device as one whole nvidia.com/gpu; every card in
                               # MIG mode with one profile), mixed (nvidia.com/mig-<profile> each) or
                               # dynamic (MIG on demand: each vGPU a MIG instance of the smallest
                               # profile that holds it, made at Allocate, reclaimed after)
    enforcement:               # the node monitor's second line of defence (docs/device-plugin.md)
      memory: kill             # a container holding more device memory than granted: kill (SIGKILL
                               # its process holding the most), evict (the Eviction API) or report
      compute: throttle        # launches run past the node's compute gate: throttle (the cgroup
                               # freezer), evict, kill (its process with the most GPU time) or report
      memoryToleranceMiB: 256  # allowed past the grant per process on a card (driver context memory)
      intervalMs: 100          # how often the driver's per-process memory is read (10..500)
      driverCap: auto          # the driver's own cap on each container's cgroup (r615+, cgroup v2):
                               # auto (where the driver has it), off, or required (refuse a container
                               # that no line holds: no hook region and no driver cap)
    nodes:                     # per-node overrides of the keys above, by node name
      gpu-node-7: {split: 4, enforcement: {memory: report}}

A bad value stops the plugin at start with the file, the field and the fix; it never runs
half-configured.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from vgpu.core.config import SchedulerConfig
from vgpu.core.errors import ConfigError
from vgpu.node.folders import FOLDER_KINDS

_RESOURCE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


@dataclass(frozen=True)
class NodeConfig:
    split: int = 10
    device_memory_scaling: float = 1.0
    device_core_scaling: float = 1.0
    oversubscribe: bool = False
    resource_name: str = "nvidia.com/gpu"
    sm_policy: str = "cap"
    driver_inject: str = "runtime"  # the chart's default is plugin
    cdi_kind: str = "nvidia.com/gpu"  # cdiKind (driverInject: cdi)
    enforce_memory: str = "kill"  # enforcement.memory
    memory_tolerance_mib: int = 256  # enforcement.memoryToleranceMiB
    enforce_interval_ms: int = 100  # enforcement.intervalMs
    enforce_compute: str = "throttle"  # enforcement.compute
    driver_cap: str = "auto"  # enforcement.driverCap (vgpu/monitor/drivercap.py)
    default_mem: int = 0  # the scheduler's defaultMem (MiB per vGPU when a container gives none)
    default_cores: int = 0  # the scheduler's defaultCores
    container_folder: str = "directory"  # containerFolder: tmpfs or directory (vgpu/node/folders.py)
    mig_strategy: str = "none"  # migStrategy: none, single, mixed or dynamic (docs/mig.md)
    sharing_mode: str = "timeslice"  # sharingMode: timeslice or mps (docs/mps.md)

    @cached_property
    def request_settings(self) -> SchedulerConfig:
        """What :func:`vgpu.core.requests.parse_pod` needs to read a pod as the scheduler did."""
        return SchedulerConfig(default_mem=self.default_mem, default_cores=self.default_cores)


_FIELDS = {
    "split": "split",
    "deviceMemoryScaling": "device_memory_scaling",
    "deviceCoreScaling": "device_core_scaling",
    "oversubscribe": "oversubscribe",
    "resourceName": "resource_name",
    "smPolicy": "sm_policy",
    "driverInject": "driver_inject",
    "cdiKind": "cdi_kind",
    "defaultMem": "default_mem",
    "defaultCores": "default_cores",
    "containerFolder": "container_folder",
    "migStrategy": "mig_strategy",
    "sharingMode": "sharing_mode",
}
SHARING_MODES = ("timeslice", "mps")
MIG_STRATEGIES = ("none", "single", "mixed", "dynamic")
SM_POLICIES = ("cap", "elastic")
INJECT_MODES = ("plugin", "cdi", "runtime")
MEMORY_ACTIONS = ("kill", "evict", "report")
COMPUTE_ACTIONS = ("throttle", "evict", "kill", "report")
DRIVER_CAP_MODES = ("auto", "off", "required")
_ENFORCEMENT = {
    "memory": "enforce_memory",
    "compute": "enforce_compute",
    "memoryToleranceMiB": "memory_tolerance_mib",
    "intervalMs": "enforce_interval_ms",
    "driverCap": "driver_cap",
}


def _enforcement(cfg: NodeConfig, doc: Any, source: str, prefix: str) -> NodeConfig:
    if not isinstance(doc, dict):
        raise ConfigError(
            source, prefix, "must be a mapping of memory, compute, memoryToleranceMiB, intervalMs, driverCap"
        )
    for key, value in doc.items():
        path = f"{prefix}.{key}"
        if key not in _ENFORCEMENT:
            raise ConfigError(source, path, f"unknown key; known keys: {', '.join(sorted(_ENFORCEMENT))}")
        if key == "memory" and value not in MEMORY_ACTIONS:
            raise ConfigError(
                source,
                path,
                f"must be kill (SIGKILL the container's process holding the most), evict (the Eviction "
                f"API) or report (an Event, a log line and a metric only), got {value!r}",
            )
        if key == "compute" and value not in COMPUTE_ACTIONS:
            raise ConfigError(
                source,
                path,
                f"must be throttle (freeze the container's cgroup for part of the time), evict (the "
                f"Eviction API), kill (SIGKILL its process with the most GPU time) or report (an Event, a "
                f"log line and a metric only), got {value!r}",
            )
        if key == "driverCap" and value is False:
            value = "off"  # YAML 1.1 reads a bare off as false
        if key == "driverCap" and value not in DRIVER_CAP_MODES:
            raise ConfigError(
                source,
                path,
                f"must be auto (the driver's cap on each container's cgroup where the driver has it), off, "
                f"or required (refuse a container no line can hold: no hook region and no driver cap), "
                f"got {value!r}",
            )
        if key == "memoryToleranceMiB" and (
            isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65536
        ):
            raise ConfigError(source, path, f"must be a whole number of MiB from 0 to 65536, got {value!r}")
        if key == "intervalMs" and (
            isinstance(value, bool) or not isinstance(value, int) or not 10 <= value <= 500
        ):
            raise ConfigError(
                source,
                path,
                f"must be a whole number of ms from 10 to 500 (to act within 1 s), got {value!r}",
            )
        cfg = replace(cfg, **{_ENFORCEMENT[key]: value})
    return cfg


def _apply(cfg: NodeConfig, doc: dict[str, Any], source: str, prefix: str) -> NodeConfig:
    for key, value in doc.items():
        path = f"{prefix}{key}"
        if key == "enforcement":
            cfg = _enforcement(cfg, value, source, path)
            continue
        if key not in _FIELDS:
            raise ConfigError(
                source, path, f"unknown key; known keys: {', '.join(sorted(_FIELDS))}, enforcement, nodes"
            )
        if key == "split":
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
                raise ConfigError(source, path, f"must be an integer from 1 to 100, got {value!r}")
        elif key in ("deviceMemoryScaling", "deviceCoreScaling"):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 100:
                raise ConfigError(
                    source, path, f"must be a number above 0 (1 = the card as it is), got {value!r}"
                )
            value = float(value)
        elif key in ("defaultMem", "defaultCores"):
            top = 100 if key == "defaultCores" else 1 << 20
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
                raise ConfigError(
                    source,
                    path,
                    f"must be a whole number from 0 to {top} (the scheduler's {key}: set both from one "
                    f"value), got {value!r}",
                )
        elif key == "containerFolder" and value not in FOLDER_KINDS:
            raise ConfigError(
                source,
                path,
                f"must be tmpfs (each container's region folder a small tmpfs of its own, nosuid,nodev,"
                f"noexec; needs CAP_SYS_ADMIN) or directory (a plain folder), got {value!r}",
            )
        elif key == "oversubscribe":
            if not isinstance(value, bool):
                raise ConfigError(source, path, f"must be true or false, got {value!r}")
        elif key == "resourceName":
            if not isinstance(value, str) or not _RESOURCE.match(value):
                raise ConfigError(
                    source, path, f"must be an extended resource name like nvidia.com/gpu, got {value!r}"
                )
        elif key == "smPolicy":
            if value not in SM_POLICIES:
                raise ConfigError(
                    source,
                    path,
                    f"must be cap (hold each container to its SM share) or elastic (a container alone on its "
                    f"card may use idle SMs), got {value!r}",
                )
        elif key == "driverInject" and value not in INJECT_MODES:
            raise ConfigError(
                source,
                path,
                f"must be plugin (the plugin hands containers the cards' device nodes and the driver's "
                f"libraries itself), cdi (the node's CDI spec, by device name) or runtime (NVIDIA's "
                f"container toolkit, told the cards by volume mounts), got {value!r}",
            )
        elif key == "migStrategy" and value not in MIG_STRATEGIES:
            raise ConfigError(
                source,
                path,
                f"must be none (cards in MIG mode offered whole, as without MIG), single (each MIG device "
                f"offered as one nvidia.com/gpu; every card in MIG mode with one profile), mixed (each "
                f"MIG device as nvidia.com/mig-<profile>) or dynamic (MIG on demand: each vGPU a MIG "
                f"instance made at Allocate and reclaimed after), got {value!r}",
            )
        elif key == "sharingMode" and value not in SHARING_MODES:
            raise ConfigError(
                source,
                path,
                f"must be timeslice (containers share each card in time slices under the hook) or mps "
                f"(each card's MPS daemon shares it by threads; pods opt in with nvidia.com/vgpu-mode: "
                f"mps, docs/mps.md), got {value!r}",
            )
        elif key == "cdiKind" and (not isinstance(value, str) or not _RESOURCE.match(value)):
            raise ConfigError(source, path, f"must be a CDI kind like nvidia.com/gpu, got {value!r}")
        cfg = replace(cfg, **{_FIELDS[key]: value})
    return cfg


def parse_node_config(text: str, node: str, source: str) -> NodeConfig:
    """The config of ``node``: top-level keys, then its entry under ``nodes``; raises ConfigError."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(source, "", f"not valid YAML ({err})") from err
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(source, "", "must be a mapping of settings (see docs/device-plugin.md)")
    doc = dict(doc)
    nodes = doc.pop("nodes", {}) or {}
    if not isinstance(nodes, dict):
        raise ConfigError(source, "nodes", "must map node names to settings")
    cfg = _apply(NodeConfig(), doc, source, "")
    own = nodes.get(node, {}) or {}
    if not isinstance(own, dict):
        raise ConfigError(source, f"nodes.{node}", "must be a mapping of settings")
    cfg = _apply(cfg, own, source, f"nodes.{node}.")
    if cfg.device_memory_scaling > 1 and not cfg.oversubscribe:
        where = f"nodes.{node}.deviceMemoryScaling" if "deviceMemoryScaling" in own else "deviceMemoryScaling"
        raise ConfigError(
            source,
            where,
            f"{cfg.device_memory_scaling} promises more memory than the cards have; "
            "set oversubscribe: true to spill the excess to host memory, or use a value <= 1",
        )
    if cfg.sharing_mode == "mps" and cfg.mig_strategy == "dynamic":
        where = f"nodes.{node}." if "sharingMode" in own or "migStrategy" in own else ""
        raise ConfigError(
            source,
            f"{where}sharingMode",
            "sharingMode: mps cannot go with migStrategy: dynamic (a card is either cut into MIG instances "
            "on demand or shared through its MPS daemon): set sharingMode: timeslice, or another "
            "migStrategy",
        )
    return cfg


def load_node_config(path: Path | None, node: str) -> NodeConfig:
    if path is None:
        return NodeConfig()
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(str(path), "", f"cannot read the node config ({err.strerror})") from err
    return parse_node_config(text, node, str(path))
