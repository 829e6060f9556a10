"""Where the real node is and what it is called: its name, taints and addresses, the host paths it
takes, the files under ``<sandbox>/real-node`` (:class:`NodeLayout`), the images ``make images``
built, and the inventory ``up --real-node`` writes."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vgpu_sandbox import binaries, realruntime
from vgpu_sandbox.runtime import Handle

NAME = "real-node-0"
# GPU nodes are commonly tainted so that only pods asking for GPUs land there; the API server's
# ExtendedResourceToleration admission plugin gives every pod that asks for nvidia.com/gpu the
# toleration, and the chart's DaemonSet tolerates it.
TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
# And the sandbox keeps its real node to pods that ask for it, so that pods meant for the KWOK
# nodes (examples/pods.yaml, with images this machine cannot pull) never land there. Not in DRA
# mode: the extender keeps those pods off a DRA node already, and a DRA pod (examples/dra.yaml)
# tolerates the GPU taint as on any cluster, not the sandbox's own.
RESERVED = {"key": "sandbox.vgpu.openaios.io/real-node", "value": "true", "effect": "NoSchedule"}
TOLERATIONS = [{"key": t["key"], "operator": "Exists", "effect": "NoSchedule"} for t in (TAINT, RESERVED)]
BRIDGE = "vgpu-sbx0"
POD_SUBNET = "10.244.200.0/24"
# The node's address: the bridge's gateway, made before the kubelet starts. Not 127.0.0.1 (the
# kubelet refuses a loopback node IP) and not the machine's own address (the kubelet's port
# stays off the machine's networks).
NODE_IP = "10.244.200.1"
HOST_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
HOST_PATHS = (Path("/var/lib/kubelet"), Path("/var/log/pods"), realruntime.STATE_DIR)
IMAGES = ("device-plugin", "scheduler", "kube-scheduler", "sample", "pause")
COMPONENTS = ("containerd", "kubelet")
# The port the node's monitor serves, by its name in state.json: the chart's plugin's, or with
# --real-gpu the sandbox's own device plugin's (vgpu_sandbox.realgpu).
MONITOR_PORT = "real-node-monitor"
FAKE_NVML_MOUNT = "/etc/vgpu/fake-nvml"  # the real node's folder as the device plugin's pod sees it


@dataclass(frozen=True)
class NodeLayout:
    """Where the real node keeps its files, under ``<sandbox>/real-node``."""

    root: Path

    @property
    def containerd_config(self) -> Path:
        return self.root / "containerd.toml"

    @property
    def containerd_socket(self) -> Path:
        return self.root / "run" / "containerd.sock"

    @property
    def containerd_root(self) -> Path:
        return self.root / "containerd"

    @property
    def containerd_state(self) -> Path:
        return self.root / "run" / "containerd"

    @property
    def runc_root(self) -> Path:
        return self.root / "run" / "runc"

    @property
    def cni_conf_dir(self) -> Path:
        return self.root / "cni" / "net.d"

    @property
    def cni_data(self) -> Path:
        return self.root / "cni" / "ipam"

    @property
    def kubelet_root(self) -> Path:
        return self.root / "kubelet"

    @property
    def kubelet_config(self) -> Path:
        return self.root / "kubelet-config.yaml"

    @property
    def gpus_file(self) -> Path:
        return self.root / "gpus.yaml"

    @property
    def stub_procs(self) -> Path:
        """Where the stub driver in the sample pods records each process's device memory, which
        the fake NVML backend reads back (its ``processDir``), as the real driver keeps it for NVML."""
        return self.root / "stub-procs"

    @property
    def record(self) -> Path:
        """What the sandbox created on the host and how often it restarted what (JSON)."""
        return self.root / "node.json"


def layout_of(sandbox: Handle) -> NodeLayout:
    return NodeLayout(sandbox.state_dir / "real-node")


def image_dir() -> Path:
    env = os.environ.get("VGPU_IMAGE_DIR")
    return Path(env) if env else binaries.repo_root() / ".cache" / "images"


def built_images() -> dict[str, dict[str, Any]]:
    """``images.json`` of ``make images``: name -> {ref, file, ...}; empty when none was built."""
    try:
        raw = json.loads((image_dir() / "images.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in raw.items() if isinstance(v, dict) and Path(str(v.get("file", ""))).is_file()}


def inventory_file(sandbox: Handle) -> Path:
    """The Ansible inventory of a sandbox with a real node (``up --real-node`` writes it)."""
    return sandbox.state_dir / "inventory.yml"


def pod_cgroups(cgroup_fs: Path = Path("/sys/fs/cgroup")) -> Path:
    """Where the real node's containers' cgroups are: the kubelet runs without a QoS tree
    (cgroupsPerQOS false), so containerd puts them under its own k8s.io, in the unified hierarchy
    on cgroup v2 and in the v1 freezer's otherwise. The chart's plugin mounts only this folder."""
    if (cgroup_fs / "cgroup.controllers").exists():
        return cgroup_fs / "k8s.io"
    return cgroup_fs / "freezer" / "k8s.io"


def images_for(real_gpu: bool) -> tuple[str, ...]:
    """The images the node imports: only the pause image on the machine's GPUs (``--real-gpu``)."""
    return ("pause",) if real_gpu else IMAGES
