"""The real node's two daemons: containerd's and the kubelet's command lines, the waits for them
to answer, the ``ctr`` and ``crictl`` clients of this node's containerd, and the shims it left."""

from __future__ import annotations

import os
import socket
import subprocess

from vgpu_sandbox import binaries, realruntime
from vgpu_sandbox.realnode.configs import snapshotter
from vgpu_sandbox.realnode.layout import NAME, NODE_IP, NodeLayout
from vgpu_sandbox.runtime import Handle


def ctr(lay: NodeLayout, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binaries.bin_dir() / "ctr"), f"--address={lay.containerd_socket}", "--namespace=k8s.io", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "CONTAINERD_SNAPSHOTTER": snapshotter()},
    )


def crictl(lay: NodeLayout, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
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


def containerd_argv(lay: NodeLayout) -> list[str]:
    return [
        *realruntime.containerd_env(lay.root),  # the NVIDIA runtime's config (vgpu_sandbox.realruntime)
        str(binaries.bin_dir() / "containerd"),
        f"--config={lay.containerd_config}",
        "--log-level=info",
    ]


def kubelet_argv(sandbox: Handle, lay: NodeLayout) -> list[str]:
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


def wait_containerd(sandbox: Handle, lay: NodeLayout) -> None:
    def answers() -> bool:
        if ctr(lay, "version", timeout=10).returncode != 0:
            return False
        # The CRI (what the kubelet and crictl speak) is a plugin that comes up after containerd's
        # own API: right after a restart `ctr version` answers while `crictl ps` still fails.
        if (binaries.bin_dir() / "crictl").exists():
            return crictl(lay, "version", timeout=30).returncode == 0
        return True

    sandbox.wait_for("containerd and its CRI to answer on its socket", answers, 60, "containerd")


def wait_kubelet(sandbox: Handle, healthz_port: int) -> None:
    def healthy() -> bool:
        with socket.create_connection(("127.0.0.1", healthz_port), timeout=1) as s:
            s.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            return b" 200 " in s.recv(256)

    sandbox.wait_for("the kubelet's /healthz", healthy, 90, "kubelet")


def shims_of(lay: NodeLayout) -> list[int]:
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
