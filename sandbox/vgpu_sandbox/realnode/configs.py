"""The real node's configuration files: containerd 2's (config version 3, CDI on), the CNI
bridge's, and the kubelet's ``KubeletConfiguration``; and the snapshotter this kernel allows."""

from __future__ import annotations

import contextlib
import functools
import subprocess
from pathlib import Path
from typing import Any

from vgpu_sandbox import binaries
from vgpu_sandbox.realnode.layout import BRIDGE, NODE_IP, POD_SUBNET, RESERVED, TAINT, NodeLayout

# Where CDI specs are read from (containerd's defaults, written out): DRA drivers write theirs to
# /var/run/cdi, nvidia-ctk's generated ones live in /etc/cdi.
CDI_SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")


@functools.cache
def snapshotter() -> str:
    """overlayfs where the kernel has it (loading the module if it can), else native (copies)."""

    def has_overlay() -> bool:
        with contextlib.suppress(OSError):
            return any(line.split()[-1] == "overlay" for line in open("/proc/filesystems") if line.strip())
        return False

    if not has_overlay():
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(["modprobe", "overlay"], capture_output=True, timeout=30)
    return "overlayfs" if has_overlay() else "native"


def containerd_config(
    lay: NodeLayout, sandbox_image: str, cni_bin: Path, snapshotter: str = "overlayfs"
) -> str:
    """containerd 2's config (version 3), every path its own; the CRI as the kubelet needs it.

    Version 3 splits the CRI into ``io.containerd.cri.v1.images`` (snapshotter, the pause image),
    ``io.containerd.cri.v1.runtime`` (runtimes, CNI, CDI) and ``io.containerd.grpc.v1.cri`` (the
    server). The runc shim is named by path (``runtime_path``), so that a machine's other
    containerd (Debian's shim on PATH) is never picked; nvidia-ctk copies it into the nvidia
    runtime. NRI is off: its socket would be a fixed host path."""
    images = 'plugins."io.containerd.cri.v1.images"'
    runtime = 'plugins."io.containerd.cri.v1.runtime"'
    shim = (binaries.bin_dir() / "containerd-shim-runc-v2").resolve()
    cdi_dirs = ", ".join(f'"{d}"' for d in CDI_SPEC_DIRS)
    return f"""\
version = 3
root = "{lay.containerd_root}"
state = "{lay.containerd_state}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.nri.v1.nri"]

[grpc]
  address = "{lay.containerd_socket}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{lay.containerd_root}/opt"

[{images}]
  snapshotter = "{snapshotter}"

[{images}.pinned_images]
  sandbox = "{sandbox_image}"

[{runtime}]
  # Machines that refuse writes to oom_score_adj (some micro-VMs) fail every container otherwise.
  restrict_oom_score_adj = true
  enable_selinux = false
  # Devices handed to containers by name (DRA drivers, nvidia-ctk's specs).
  enable_cdi = true
  cdi_spec_dirs = [{cdi_dirs}]

[{runtime}.containerd]
  default_runtime_name = "runc"

[{runtime}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  runtime_path = "{shim}"

[{runtime}.containerd.runtimes.runc.options]
  Root = "{lay.runc_root}"
  SystemdCgroup = false

[{runtime}.cni]
  bin_dirs = ["{cni_bin}"]
  conf_dir = "{lay.cni_conf_dir}"
"""


def cni_config(lay: NodeLayout) -> dict[str, Any]:
    return {
        "cniVersion": "0.4.0",
        "name": "vgpu-sandbox",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(lay.cni_data),
                    "ranges": [[{"subnet": POD_SUBNET}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "loopback"},
        ],
    }


def kubelet_config(
    lay: NodeLayout, port: int, healthz_port: int, ca: Path, serving: tuple[Path, Path], dra: bool = False
) -> dict[str, Any]:
    """A KubeletConfiguration for a node that shares its machine with the sandbox's other parts;
    ``dra``: the node in DRA mode, tainted as a GPU node only (:data:`RESERVED`)."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": NODE_IP,
        "tlsCertFile": str(serving[0]),
        "tlsPrivateKeyFile": str(serving[1]),
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "containerRuntimeEndpoint": f"unix://{lay.containerd_socket}",
        "imageServiceEndpoint": f"unix://{lay.containerd_socket}",
        # The machine's cgroups are the machine's: no QoS tree, no node-allocatable enforcement.
        "cgroupDriver": "cgroupfs",
        "cgroupsPerQOS": False,
        "enforceNodeAllocatable": [],
        "failSwapOn": False,
        # From 1.35 on the kubelet refuses cgroup v1 hosts unless told otherwise; the sandbox runs
        # on the machine's hierarchy as it is (some CI machines and micro-VMs still have v1).
        "failCgroupV1": False,
        "localStorageCapacityIsolation": False,
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "registerWithTaints": [TAINT] if dra else [TAINT, RESERVED],
        # Only holders of a certificate from the sandbox's CA (the API server's kubelet client)
        # may call it: logs, exec, and the rest of the kubelet's API.
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(ca)},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "serializeImagePulls": False,
        "nodeStatusReportFrequency": "10s",
        "shutdownGracePeriod": "0s",
    }
