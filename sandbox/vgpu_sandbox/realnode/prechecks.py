"""Why a real node cannot run on this machine (:func:`why_not`), naming the fix: root, the runtime
packages, cgroups, namespaces, the built kubelet, containerd, crictl and NVIDIA's runtime, the
images, and no other kubelet on the machine. ``Sandbox.up`` asks before it starts anything."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

from vgpu_sandbox import binaries, realgpu, realruntime
from vgpu_sandbox.realnode.layout import HOST_PLUGIN_DIR, built_images, image_dir, images_for

SYSTEM_BINARIES = {"runc": "runc"}
# containerd 2 (tools/build.sh containerd): Debian's containerd 1.6 has no CDI.
CONTAINERD_BINARIES = ("containerd", "containerd-shim-runc-v2", "ctr")
CNI_DIRS = (Path("/usr/lib/cni"), Path("/opt/cni/bin"))
CNI_PLUGINS = ("bridge", "host-local", "loopback")


def system_binary(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(p / name) for p in (Path("/usr/bin"), Path("/usr/sbin")) if (p / name).exists()), None
    )


def cni_dir() -> Path | None:
    return next((d for d in CNI_DIRS if all((d / p).exists() for p in CNI_PLUGINS)), None)


def socket_answers(path: Path) -> bool:
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
    missing = sorted({pkg for name, pkg in SYSTEM_BINARIES.items() if system_binary(name) is None})
    if cni_dir() is None:
        missing.append("containernetworking-plugins")
    if missing:
        return (
            f"the container runtime is not installed (Debian packages {', '.join(missing)}); "
            "run `make setup` as root, or `apt-get install runc containernetworking-plugins`"
        )
    if not (Path("/sys/fs/cgroup/cgroup.controllers").exists() or Path("/sys/fs/cgroup/memory").is_dir()):
        return "no cgroup hierarchy is mounted at /sys/fs/cgroup, so runc cannot contain processes"
    for tool, package in (("unshare", "util-linux"), ("ip", "iproute2")):
        if system_binary(tool) is None:
            return f"{tool} is missing (Debian package {package}); install it"
    probe = subprocess.run(
        ["unshare", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        return f"this machine cannot create namespaces (unshare: {probe.stderr.strip() or probe.returncode})"
    lacking = [n for n in tools(real_gpu) if not (binaries.bin_dir() / n).exists()]
    if lacking:
        pieces = ["kubelet", "containerd"] + ([] if real_gpu else ["crictl", "nvidia-ctk"])
        return (
            f"{', '.join(lacking)} not built in {binaries.bin_dir()}: run `make setup` as root "
            f"(tools/build.sh {' '.join(pieces)}), or point VGPU_BIN_DIR at the cache that holds them"
        )
    have = built_images()
    absent = [n for n in images_for(real_gpu) if n not in have]
    if absent:
        return f"images {', '.join(absent)} not built in {image_dir()}: run `make images` (needs root)"
    if real_gpu:
        reason = realgpu.why_not()
        if reason:
            return reason
    if socket_answers(HOST_PLUGIN_DIR / "kubelet.sock"):
        return (
            f"another kubelet serves {HOST_PLUGIN_DIR / 'kubelet.sock'} on this machine; a machine holds "
            "one real node (stop the other sandbox with `vgpu sandbox down --dir ...`)"
        )
    return None


def tools(real_gpu: bool) -> tuple[str, ...]:
    return ("kubelet", *CONTAINERD_BINARIES) + (() if real_gpu else ("crictl", realruntime.RUNTIME))
