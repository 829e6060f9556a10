"""The real node on this machine's NVIDIA GPUs (``vgpu sandbox up --real-node --real-gpu``).

Where the plain real node runs the chart's device plugin on fake cards (the stub driver in the
sample image), this one runs ``vgpu device-plugin`` as a process of the sandbox on the machine's
real cards (NVML), with the hook ``make native`` built, and with ``driverInject: plugin``: the
plugin hands each container the driver's device nodes and libraries itself, since the node's
containerd runs plain runc, without NVIDIA's container toolkit. Only the pause image is imported;
the workload's image is the caller's (tests/gpu/test_pod_on_gpu.py builds one from the machine's
Python and PyTorch).
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from vgpu.core.errors import ConfigError
from vgpu.core.requests import RESOURCE_GPU
from vgpu.node.driver import find_driver
from vgpu_sandbox import product
from vgpu_sandbox.realnode.layout import MONITOR_PORT
from vgpu_sandbox.runtime import Handle, Spec

COMPONENT = "device-plugin-real-node"


def why_not() -> str | None:
    """Why the real node cannot use this machine's GPUs, naming the fix; None when it can."""
    try:
        find_driver(Path("/"))
    except ConfigError as err:
        return f"no NVIDIA driver on this machine: {err}"
    if not Path("/dev/nvidiactl").exists():
        return "/dev/nvidiactl is missing: the NVIDIA driver's kernel modules are not loaded"
    if product.hook_library() is None:
        return "native/hook/build/libvgpu.so is not built: run `make native`"
    return None


def start_plugin(sandbox: Handle, spec: Spec, node: str, folder: Path) -> None:
    """``vgpu device-plugin`` on the real cards for ``node``; returns once the node advertises them."""
    hook = product.hook_library()
    assert hook is not None  # why_not checked it
    config = folder / "node-config.yaml"
    config.write_text(yaml.safe_dump({"split": spec.split, "driverInject": "plugin"}))
    port = sandbox.port(MONITOR_PORT)
    sandbox.launch(
        COMPONENT,
        [
            sys.executable,
            "-m",
            "vgpu.commands.cli",
            "device-plugin",
            f"--node={node}",
            f"--kubeconfig={product.account_kubeconfig(sandbox, COMPONENT, product.PLUGIN_ACCOUNT, node)}",
            f"--namespace={product.NAMESPACE}",
            f"--config={config}",
            f"--monitor-listen=127.0.0.1:{port}",
            f"--hook-library={hook}",
        ],
        port,
    )

    def advertised() -> bool:
        item = sandbox.api_get(f"/api/v1/nodes/{node}")
        annotations = item.get("metadata", {}).get("annotations") or {}
        allocatable = item.get("status", {}).get("allocatable", {})
        return product.INVENTORY_ANNOTATION in annotations and int(allocatable.get(RESOURCE_GPU, "0")) > 0

    sandbox.wait_for(
        f"the device plugin to advertise {node}'s GPUs (real NVML)", advertised, 90, [COMPONENT, "kubelet"]
    )
