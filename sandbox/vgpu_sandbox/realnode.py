"""The sandbox's real node: the upstream kubelet, containerd and runc on this machine.

``vgpu sandbox up --real-node`` adds, beside the KWOK nodes, one node (``real-node-0``) that runs
pods for real: containerd 2 built from Go modules (``tools/build.sh containerd``: containerd, its
runc shim and ctr) with its own configuration, root, state and socket under the sandbox's folder
and CDI on (``/etc/cdi``, ``/var/run/cdi``), runc (Debian's), the CNI bridge plugin on a bridge of
its own, and the kubelet built from Go modules at the control plane's pin (``tools/build.sh
kubelet``). The images it runs are the ones ``make images`` built (``tools/images.sh``), imported
into containerd's ``k8s.io`` namespace.

The node has no NVIDIA driver: the chart's device plugin describes its cards with the fake NVML
backend (``gpus.yaml`` here), and the sample workload image carries the stub driver libraries.
NVIDIA's container runtime is in the path all the same, containerd's default in CDI mode, with
the stub's cards as a CDI spec (``vgpu_sandbox.realruntime``).

Three host paths are fixed by Kubernetes and the product, so a machine holds one real node at a
time: ``/var/lib/kubelet/device-plugins`` (kubelet's registration socket, whatever its
``--root-dir``), ``/var/log/pods`` (container logs) and ``/var/lib/vgpu`` (the hook, grants and
regions). Whatever of them the sandbox created, it removes at ``down``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vgpu_sandbox import binaries, nodes, procs, realdra, realgpu, realmps, realruntime
from vgpu_sandbox.errors import SandboxError
from vgpu_sandbox.runtime import Handle, Spec

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
HOST_PATHS = (Path("/var/lib/kubelet"), Path("/var/log/pods"), Path("/var/lib/vgpu"))
SYSTEM_BINARIES = {"runc": "runc"}
# containerd 2 (tools/build.sh containerd): Debian's containerd 1.6 has no CDI.
CONTAINERD_BINARIES = ("containerd", "containerd-shim-runc-v2", "ctr")
# Where CDI specs are read from (containerd's defaults, written out): DRA drivers write theirs to
# /var/run/cdi, nvidia-ctk's generated ones live in /etc/cdi.
CDI_SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")
CNI_DIRS = (Path("/usr/lib/cni"), Path("/opt/cni/bin"))
CNI_PLUGINS = ("bridge", "host-local", "loopback")
IMAGES = ("device-plugin", "scheduler", "kube-scheduler", "sample", "pause")
COMPONENTS = ("containerd", "kubelet")


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


def _system_binary(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(p / name) for p in (Path("/usr/bin"), Path("/usr/sbin")) if (p / name).exists()), None
    )


def _cni_dir() -> Path | None:
    return next((d for d in CNI_DIRS if all((d / p).exists() for p in CNI_PLUGINS)), None)


def _socket_answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True


def why_not(real_gpu: bool = False) -> str | None:
    """Why a real node cannot run on this machine, naming the fix; None when it can.

    ``real_gpu``: on the machine's NVIDIA GPUs (vgpu_sandbox.realgpu), which needs only the pause
    image and no crictl."""
    if os.geteuid() != 0:
        return (
            "a real node needs root: containerd, runc and the kubelet mount file systems and create "
            "namespaces and cgroups (run as root, or use the KWOK nodes alone)"
        )
    missing = sorted({pkg for name, pkg in SYSTEM_BINARIES.items() if _system_binary(name) is None})
    if _cni_dir() is None:
        missing.append("containernetworking-plugins")
    if missing:
        return (
            f"the container runtime is not installed (Debian packages {', '.join(missing)}); "
            "run `make setup` as root, or `apt-get install runc containernetworking-plugins`"
        )
    if not (Path("/sys/fs/cgroup/cgroup.controllers").exists() or Path("/sys/fs/cgroup/memory").is_dir()):
        return "no cgroup hierarchy is mounted at /sys/fs/cgroup, so runc cannot contain processes"
    for tool, package in (("unshare", "util-linux"), ("ip", "iproute2")):
        if _system_binary(tool) is None:
            return f"{tool} is missing (Debian package {package}); install it"
    probe = subprocess.run(
        ["unshare", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        return f"this machine cannot create namespaces (unshare: {probe.stderr.strip() or probe.returncode})"
    lacking = [n for n in _tools(real_gpu) if not (binaries.bin_dir() / n).exists()]
    if lacking:
        pieces = ["kubelet", "containerd"] + ([] if real_gpu else ["crictl", "nvidia-ctk"])
        return (
            f"{', '.join(lacking)} not built in {binaries.bin_dir()}: run `make setup` as root "
            f"(tools/build.sh {' '.join(pieces)}), or point VGPU_BIN_DIR at the cache that holds them"
        )
    have = built_images()
    absent = [n for n in _images(real_gpu) if n not in have]
    if absent:
        return f"images {', '.join(absent)} not built in {image_dir()}: run `make images` (needs root)"
    if real_gpu:
        reason = realgpu.why_not()
        if reason:
            return reason
    if _socket_answers(HOST_PLUGIN_DIR / "kubelet.sock"):
        return (
            f"another kubelet serves {HOST_PLUGIN_DIR / 'kubelet.sock'} on this machine; a machine holds "
            "one real node (stop the other sandbox with `vgpu sandbox down --dir ...`)"
        )
    return None


def _tools(real_gpu: bool) -> tuple[str, ...]:
    return ("kubelet", *CONTAINERD_BINARIES) + (() if real_gpu else ("crictl", realruntime.RUNTIME))


def _images(real_gpu: bool) -> tuple[str, ...]:
    return ("pause",) if real_gpu else IMAGES


# ---- configuration files -------------------------------------------------------------------
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


def _merge(into: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
    return into


def inventory(sandbox: Handle, spec: Spec, ctk: Path | None, values: dict[str, Any]) -> dict[str, Any]:
    """``inventory/sandbox.yml`` with this sandbox's KWOK nodes and the real node as GPU hosts, and
    the chart values the real node needs merged into the control host's."""
    base = yaml.safe_load((binaries.repo_root() / "inventory" / "sandbox.yml").read_text())
    children = base["all"]["children"]
    control_vars = children["kube_control"].setdefault("vars", {})
    control_vars["vgpu_scheduler_values"] = _merge(control_vars.get("vgpu_scheduler_values") or {}, values)
    kwok_vars = children["gpu_nodes"]["vars"]
    lay = layout_of(sandbox)
    real_vars = {
        "ansible_connection": "local",
        "ansible_python_interpreter": "{{ ansible_playbook_python }}",
        "ansible_become": False,
        "gpu_node_prepare_host": True,
        # No driver: the fake NVML backend describes the cards, the sample image has the stub.
        "gpu_node_driver_check": False,
        # The toolkit's package comes from NVIDIA's repository; here nvidia-ctk is built from Go
        # modules (tools/build.sh nvidia-ctk), as a node image with the toolkit baked in has it.
        "gpu_node_install_toolkit": False,
        "gpu_node_nvidia_ctk": str(ctk) if ctk else "/usr/bin/nvidia-ctk",
        "gpu_node_container_runtime": "containerd",
        "gpu_node_containerd_config": str(lay.containerd_config),
        # NVIDIA's runtime, built from Go modules, containerd's default in CDI mode (realruntime)
        **realruntime.role_vars(lay.root),
        "gpu_node_backup": False,
        # containerd runs under the sandbox, not systemd.
        "gpu_node_containerd_restart_command": [
            str(Path(sys.executable).parent / "vgpu"),
            "sandbox",
            f"--dir={sandbox.state_dir}",
            "restart",
            "containerd",
        ],
    }
    children["gpu_nodes"] = {
        "hosts": {
            **{nodes.node_name(i): {**kwok_vars} for i in range(spec.nodes)},
            NAME: real_vars,
        },
    }
    return base


def chart_values(sandbox: Handle, spec: Spec, lay: NodeLayout, monitor_port: int) -> dict[str, Any]:
    """What the chart's device-plugin DaemonSet needs on this real node (and harmlessly on KWOK's)."""
    state = sandbox.state()
    assert state is not None
    api_port = state.ports["apiserver"]
    return {
        # The cards reach containers as CDI devices of the stub's spec (realruntime): no driver here
        # to hand out, and NVIDIA's runtime in the path refuses a container's own variable.
        "driver": {"inject": "cdi"},
        "devicePlugin": {
            "image": {
                "registry": "docker.io",
                "repository": "vgpu/device-plugin",
                "tag": "dev",
                "pullPolicy": "Never",
            },
            # The sandbox runs no kube-proxy: the pod reaches the API server on the node's
            # 127.0.0.1 through the host's network, at the address the API server advertises.
            "hostNetwork": True,
            "extraEnv": [
                {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
                {"name": "KUBERNETES_SERVICE_PORT", "value": str(api_port)},
            ],
            "extraArgs": [f"--fake-nvml={FAKE_NVML_MOUNT}/gpus.yaml"],
            "extraVolumes": [
                {"name": "fake-nvml", "hostPath": {"path": str(lay.gpus_file.parent), "type": "Directory"}}
            ],
            "extraVolumeMounts": [{"name": "fake-nvml", "mountPath": FAKE_NVML_MOUNT, "readOnly": True}],
            "monitor": {"port": monitor_port},
            # the kubelet's pod cgroups here (cgroupfs driver), for the throttle's freezer alone
            "hostPaths": {"podCgroups": [str(pod_cgroups())]},
            "deviceSplitCount": spec.split,
            "tolerations": TOLERATIONS,
        },
    }


def pod_cgroups(cgroup_fs: Path = Path("/sys/fs/cgroup")) -> Path:
    """Where the real node's containers' cgroups are: the kubelet runs without a QoS tree
    (cgroupsPerQOS false), so containerd puts them under its own k8s.io, in the unified hierarchy
    on cgroup v2 and in the v1 freezer's otherwise. The chart's plugin mounts only this folder."""
    if (cgroup_fs / "cgroup.controllers").exists():
        return cgroup_fs / "k8s.io"
    return cgroup_fs / "freezer" / "k8s.io"


def scheduler_values(sandbox: Handle) -> dict[str, Any]:
    """What the chart's scheduler Deployment needs to run on this real node: the extender, its
    kube-scheduler and the webhook in one pod, TLS and RBAC as the chart makes them.

    The node has no kube-proxy, so the pod runs in the node's network (``hostNetwork``): both
    containers reach the API server at the 127.0.0.1 it advertises (``KUBERNETES_SERVICE_HOST``
    and ``_PORT``, the in-cluster client's address), kube-scheduler calls the extender of its own
    pod (``extender.route=pod``, TLS verified against the release's CA), and the API server
    calls the webhook at the Service's ready endpoint (``--enable-aggregator-routing``). The
    pod's three ports are the machine's, so each is a free one the sandbox records."""
    state = sandbox.state()
    assert state is not None
    env = [
        {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
        {"name": "KUBERNETES_SERVICE_PORT", "value": str(state.ports["apiserver"])},
    ]
    return {
        "webhook": {"enabled": True},
        "scheduler": {
            "hostNetwork": True,
            "nodeSelector": {"kubernetes.io/hostname": NAME},
            "tolerations": TOLERATIONS,
            "kubeScheduler": {
                # the image tools/images.sh built from the cluster's own kube-scheduler, imported
                "image": {"pullPolicy": "Never"},
                "port": sandbox.port("real-node-kube-scheduler"),
                "extraEnv": env,
            },
            "extender": {
                "image": {"tag": "dev", "pullPolicy": "Never"},
                "port": sandbox.port("real-node-extender"),
                "route": "pod",
                "extraEnv": env,
            },
            "metrics": {"port": sandbox.port("real-node-scheduler-metrics")},
        },
    }


SAMPLE_IMAGE = "docker.io/vgpu/sample:dev"
FAKE_NVML_MOUNT = "/etc/vgpu/fake-nvml"  # the real node's folder as the device plugin's pod sees it
STUB_PROCS_IN_POD = "/var/run/vgpu-stub-procs"


def sample_pod(
    name: str, command: str, limits: dict[str, str] | None, card_mib: int, stub_procs: Path | None = None
) -> dict[str, Any]:
    """A pod of the sample image on the real node, running ``command`` in a shell.

    ``card_mib`` is the stub driver's card (the fake NVML describes the same size to the plugin).
    The sandbox keeps its real node to pods that ask for it; the GPU node's own taint is tolerated
    by the API server's ExtendedResourceToleration for pods asking for GPUs, so only a pod without
    ``limits`` carries that toleration itself. With ``stub_procs`` (the layout's ``stub_procs``)
    the stub driver records each process's memory there, for the device plugin's host view."""
    container: dict[str, Any] = {
        "name": "cuda",
        "image": SAMPLE_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["/bin/sh", "-c", command],
        "env": [{"name": "STUB_CUDA_MEMORY_MIB", "value": str(card_mib)}],
    }
    spec_extra: dict[str, Any] = {}
    if stub_procs is not None:
        container["env"].append({"name": "STUB_CUDA_PROCESS_DIR", "value": STUB_PROCS_IN_POD})
        container["volumeMounts"] = [{"name": "stub-procs", "mountPath": STUB_PROCS_IN_POD}]
        spec_extra["volumes"] = [
            {"name": "stub-procs", "hostPath": {"path": str(stub_procs), "type": "Directory"}}
        ]
    tolerations = [{"key": RESERVED["key"], "operator": "Exists", "effect": "NoSchedule"}]
    if limits:
        container["resources"] = {"limits": limits}
    else:
        tolerations.append({"key": TAINT["key"], "operator": "Exists", "effect": "NoSchedule"})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {"kubernetes.io/hostname": NAME},
            "terminationGracePeriodSeconds": 1,
            "containers": [container],
            "tolerations": tolerations,
            **spec_extra,
        },
    }


# ---- up --------------------------------------------------------------------------------------
def _load_record(lay: NodeLayout) -> dict[str, Any]:
    try:
        loaded = json.loads(lay.record.read_text())
        return loaded if isinstance(loaded, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_record(lay: NodeLayout, record: dict[str, Any]) -> None:
    tmp = lay.record.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(lay.record)


def _ctr(lay: NodeLayout, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binaries.bin_dir() / "ctr"), f"--address={lay.containerd_socket}", "--namespace=k8s.io", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "CONTAINERD_SNAPSHOTTER": snapshotter()},
    )


def _crictl(lay: NodeLayout, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    endpoint = f"unix://{lay.containerd_socket}"
    return subprocess.run(
        [
            str(binaries.find("crictl")),
            f"--runtime-endpoint={endpoint}",
            f"--image-endpoint={endpoint}",
            "--timeout=30s",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _containerd_argv(lay: NodeLayout) -> list[str]:
    return [
        *realruntime.containerd_env(lay.root),  # the NVIDIA runtime's config (vgpu_sandbox.realruntime)
        str(binaries.bin_dir() / "containerd"),
        f"--config={lay.containerd_config}",
        "--log-level=info",
    ]


def _kubelet_argv(sandbox: Handle, lay: NodeLayout) -> list[str]:
    return [
        str(binaries.find("kubelet")),
        f"--config={lay.kubelet_config}",
        f"--kubeconfig={sandbox.layout.identity_kubeconfig('kubelet')}",
        f"--hostname-override={NAME}",
        f"--node-ip={NODE_IP}",
        f"--root-dir={lay.kubelet_root}",
        f"--cert-dir={lay.root / 'kubelet-pki'}",
        "--v=2",
    ]


def _wait_containerd(sandbox: Handle, lay: NodeLayout) -> None:
    def answers() -> bool:
        if _ctr(lay, "version", timeout=10).returncode != 0:
            return False
        # The CRI (what the kubelet and crictl speak) is a plugin that comes up after containerd's
        # own API: right after a restart `ctr version` answers while `crictl ps` still fails.
        if (binaries.bin_dir() / "crictl").exists():
            return _crictl(lay, "version", timeout=30).returncode == 0
        return True

    sandbox.wait_for("containerd and its CRI to answer on its socket", answers, 60, "containerd")


def _wait_kubelet(sandbox: Handle, healthz_port: int) -> None:
    def healthy() -> bool:
        with socket.create_connection(("127.0.0.1", healthz_port), timeout=1) as s:
            s.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            return b" 200 " in s.recv(256)

    sandbox.wait_for("the kubelet's /healthz", healthy, 90, "kubelet")


def start(sandbox: Handle, spec: Spec, progress: Callable[[str], None]) -> None:
    """containerd, the images, then the kubelet; returns when the node is Ready.

    ``Sandbox.up`` has checked ``why_not`` before it started anything."""
    lay = layout_of(sandbox)
    lay.root.mkdir(mode=0o700)
    for folder in (
        lay.containerd_root,
        lay.containerd_state.parent,
        lay.cni_conf_dir,
        lay.cni_data,
        lay.kubelet_root,
    ):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "created": [str(p) for p in HOST_PATHS if not p.exists()],
        "restarts": {c: 0 for c in COMPONENTS},
        "timings": {},
    }
    _save_record(lay, record)
    images = built_images()
    cni_bin = _cni_dir()
    assert cni_bin is not None
    lay.containerd_config.write_text(containerd_config(lay, images["pause"]["ref"], cni_bin, snapshotter()))
    (lay.cni_conf_dir / "10-vgpu-sandbox.conflist").write_text(json.dumps(cni_config(lay), indent=2))

    progress(f"real node: starting containerd ({lay.containerd_config})")
    t0 = time.monotonic()
    sandbox.launch("containerd", _containerd_argv(lay))
    _wait_containerd(sandbox, lay)

    wanted = _images(spec.real_gpu)
    progress(f"real node: importing {len(wanted)} images from {image_dir()}")
    t1 = time.monotonic()
    for name in wanted:
        imported = _ctr(lay, "images", "import", images[name]["file"])
        if imported.returncode != 0:
            raise SandboxError(f"ctr images import {images[name]['file']} failed: {imported.stderr.strip()}")
    listed = set(_ctr(lay, "images", "list", "--quiet").stdout.split())
    absent = [images[n]["ref"] for n in wanted if images[n]["ref"] not in listed]
    if absent:
        raise SandboxError(f"containerd does not list {', '.join(absent)} after the import; see its log")
    record["timings"]["images_import_s"] = round(time.monotonic() - t1, 1)

    gpu = nodes.GPUSpec(spec.gpus_per_node, spec.gpu_memory_mib, spec.gpu_model, spec.split)
    lay.stub_procs.mkdir(exist_ok=True)
    lay.stub_procs.chmod(0o1777)  # a sample pod's process may run as any user
    gpus = nodes.fake_gpus(NAME, gpu)
    if spec.dra and spec.mig == "dynamic":
        gpus[0].update(realdra.MIG_CARD)  # the fake NVML's H100 in MIG mode (--dra --mig dynamic)
    described = {"gpus": gpus, "processDir": f"{FAKE_NVML_MOUNT}/{lay.stub_procs.name}"}
    lay.gpus_file.write_text(yaml.safe_dump(described, sort_keys=False))
    lay.gpus_file.chmod(0o644)
    realruntime.write_stub_spec(lay.root, [str(g["uuid"]) for g in gpus])
    record["shared_state"] = realruntime.share_state_dir()
    _save_record(lay, record)

    # containerd makes its k8s.io cgroup at its first container; the chart's plugin mounts it
    # (devicePlugin.hostPaths.podCgroups) and may well be that first container
    pod_cgroups().mkdir(exist_ok=True)
    progress(f"real node: starting the kubelet as {NAME}")
    sandbox.kubectl(
        "create",
        "clusterrolebinding",
        "vgpu-sandbox-real-node",
        "--clusterrole=system:node",
        f"--user=system:node:{NAME}",
    )
    _make_bridge()
    assert sandbox.ca is not None
    serving = sandbox.ca.issue("kubelet", [NODE_IP, NAME])
    port, healthz = sandbox.port("kubelet"), sandbox.port("kubelet-healthz")
    config = kubelet_config(lay, port, healthz, sandbox.ca.cert_path, (serving.cert, serving.key), spec.dra)
    lay.kubelet_config.write_text(yaml.safe_dump(config, sort_keys=False))
    sandbox.launch("kubelet", _kubelet_argv(sandbox, lay), port)
    _wait_kubelet(sandbox, healthz)

    def ready() -> bool:
        node = sandbox.api_get(f"/api/v1/nodes/{NAME}")
        conditions = node.get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    sandbox.wait_for(f"{NAME} to register and be Ready (kubelet)", ready, 120, ["kubelet", "containerd"])
    record["timings"]["containerd_to_ready_s"] = round(time.monotonic() - t0, 1)
    _save_record(lay, record)
    if spec.dra:
        where = "this machine's GPUs (real NVML)" if spec.real_gpu else "the stub driver's cards (fake NVML)"
        progress(f"real node: starting the DRA plugin on {where} for {NAME}")
        realdra.start_plugin(sandbox, spec, NAME, lay.root, lay.kubelet_root, lay.gpus_file)
        return
    if spec.real_gpu:
        progress(f"real node: starting the device plugin on this machine's GPUs (real NVML) for {NAME}")
        realgpu.start_plugin(sandbox, spec, NAME, lay.root)
        return

    ctk = binaries.bin_dir() / "nvidia-ctk"
    values = chart_values(sandbox, spec, lay, sandbox.port("real-node-monitor"))
    if spec.sharing == "mps":  # the plugin's fake MPS tool in a stub driver root (realmps)
        realmps.write_driver_root(lay.root)
        values = _merge(values, realmps.chart_values(lay.root, NAME))
        record["mps_folders"] = realmps.card_folders([str(g["uuid"]) for g in gpus])
        _save_record(lay, record)
    if not spec.local_scheduler:
        values = _merge(values, scheduler_values(sandbox))
    inventory_file(sandbox).write_text(
        yaml.safe_dump(inventory(sandbox, spec, ctk if ctk.exists() else None, values), sort_keys=False)
    )


def _make_bridge() -> None:
    """The pods' bridge with the node's address on it; the CNI bridge plugin adopts it.

    A kernel without bridges (some micro-VMs) gets the node's address on the loopback device
    instead: the kubelet still has its address, and host-network pods (what a real-GPU node's
    tests run) need no bridge; pods on the pod network cannot start there."""
    ip = ["ip"]
    if subprocess.run([*ip, "link", "show", BRIDGE], capture_output=True).returncode != 0:
        made = subprocess.run([*ip, "link", "add", BRIDGE, "type", "bridge"], capture_output=True, text=True)
        if made.returncode != 0:
            steps = [[*ip, "addr", "add", f"{NODE_IP}/32", "dev", "lo"]]
        else:
            steps = [
                [*ip, "addr", "add", f"{NODE_IP}/{POD_SUBNET.split('/')[1]}", "dev", BRIDGE],
                [*ip, "link", "set", BRIDGE, "up"],
            ]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                raise SandboxError(f"{' '.join(step)} failed: {done.stderr.strip()}")


def inventory_file(sandbox: Handle) -> Path:
    """The Ansible inventory of a sandbox with a real node (``up --real-node`` writes it)."""
    return sandbox.state_dir / "inventory.yml"


# ---- restart and down ------------------------------------------------------------------------
def restart(sandbox: Handle, component: str) -> float:
    """Stop one of the node's daemons and start it again with the same command line; seconds taken."""
    if component not in COMPONENTS:
        raise SandboxError(f"unknown component {component!r}; restart one of {', '.join(COMPONENTS)}")
    state = sandbox.state()
    if state is None:
        raise SandboxError(f"no sandbox in {sandbox.state_dir}")
    found = [c for c in state.components if c.name == component]
    if not found:
        raise SandboxError(f"this sandbox has no {component}; start it with `vgpu sandbox up --real-node`")
    lay = layout_of(sandbox)
    start_t = time.monotonic()
    old = found[-1]
    procs.stop_all([old.pid], None, grace=20)
    sandbox.adopt(state)
    state.components.remove(old)
    sandbox.launch(component, old.argv, old.port)
    if component == "containerd":
        _wait_containerd(sandbox, lay)
    else:
        _wait_kubelet(sandbox, state.ports["kubelet-healthz"])
    record = _load_record(lay)
    record.setdefault("restarts", {}).setdefault(component, 0)
    record["restarts"][component] += 1
    _save_record(lay, record)
    return time.monotonic() - start_t


def restarts(sandbox: Handle) -> dict[str, int]:
    return dict(_load_record(layout_of(sandbox)).get("restarts") or {})


def unmount_under(root: Path) -> None:
    """Detach every mount at or below ``root``, deepest first (lazily: busy ones go when freed)."""
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if point == str(root) or point.startswith(str(root) + "/"):
                found.append(point)
    for point in sorted(found, key=lambda p: p.count("/"), reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True, timeout=30)


def _shims_of(lay: NodeLayout) -> list[int]:
    """containerd-shim processes that serve this node's containerd."""
    out = []
    want = str(lay.containerd_socket).encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"containerd-shim-runc-v2") and want in argv:
            out.append(int(entry))
    return out


def stop(sandbox: Handle, pids: dict[str, int]) -> None:
    """Take the node down leaving nothing: pods through the CRI, daemons, mounts, bridge, host paths.

    ``pids`` maps the node's components to their recorded pids. Runs before the sandbox's other
    processes are stopped; every step is attempted even when an earlier one failed.
    """
    lay = layout_of(sandbox)
    if not lay.root.exists():
        return
    record = _load_record(lay)
    if "kubelet" in pids:
        procs.stop_all([pids["kubelet"]], None, grace=10)
    temporary: subprocess.Popen[bytes] | None = None
    if lay.containerd_config.exists() and not _socket_answers(lay.containerd_socket):
        # containerd is gone (a crash, a killed sandbox): start it again to remove the pods properly.
        with contextlib.suppress(OSError):
            temporary = subprocess.Popen(
                _containerd_argv(lay),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not _socket_answers(lay.containerd_socket):
                time.sleep(0.2)
    if _socket_answers(lay.containerd_socket):
        with contextlib.suppress(OSError, subprocess.SubprocessError, SandboxError):
            pods = _crictl(lay, "pods", "--quiet").stdout.split()
            if pods:
                _crictl(lay, "stopp", *pods)
                _crictl(lay, "rmp", "--force", *pods)
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            for task in _ctr(lay, "tasks", "list", "--quiet", timeout=30).stdout.split():
                _ctr(lay, "tasks", "kill", "--all", "--signal=SIGKILL", task, timeout=30)
                _ctr(lay, "tasks", "delete", "--force", task, timeout=30)
    if "containerd" in pids:
        procs.stop_all([pids["containerd"]], None, grace=10)
    with contextlib.suppress(OSError):
        realdra.forget_specs(lay.root)  # DRA mode: the specs of claims the kubelet left prepared
    if temporary is not None:
        procs.stop_group(temporary, grace=10)
    shims = _shims_of(lay)
    if shims:
        procs.stop_all(shims, None, grace=5)
    unmount_under(lay.root)
    realruntime.remove_stub_spec()
    realmps.forget(record.get("mps_folders") or [])
    if record.get("shared_state"):  # the containers' tmpfs folders and the shared bind under them
        unmount_under(realruntime.STATE_DIR)
    subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True, timeout=30)
    subprocess.run(["ip", "addr", "del", f"{NODE_IP}/32", "dev", "lo"], capture_output=True, timeout=30)
    for created in record.get("created", []):
        unmount_under(Path(created))
        shutil.rmtree(created, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        # Our kubelet's registration socket, when /var/lib/kubelet was there before us.
        (HOST_PLUGIN_DIR / "kubelet.sock").unlink()
    shutil.rmtree(lay.root, ignore_errors=True)
