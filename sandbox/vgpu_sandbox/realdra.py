"""The real node in DRA mode (``vgpu sandbox up --real-node --dra``, with or without ``--real-gpu``).

Instead of a device plugin, ``vgpu dra-plugin`` runs as a process of the sandbox for the real
node: on the machine's NVIDIA cards (real NVML) with ``driverInject: plugin`` under
``--real-gpu`` (the claims' CDI specs carry the driver's device nodes and libraries, the node's
containerd running plain runc), or over the fake NVML file of the stub driver's cards otherwise
(the sample image carries the stub driver). It is pointed at the sandbox kubelet's own plugin
and registration folders (the kubelet runs with a ``--root-dir`` of its own), keeps its grants,
region folders and records in the node's folder, and writes the claims' CDI specs to
``/var/run/cdi``, where containerd 2 reads them. The node is labelled
``openaios.io/gpu-mode=dra`` and the DeviceClass ``vgpu.openaios.io`` made as the chart makes
them; pods ask for the cards through ResourceClaims (docs/dra.md) and the default scheduler
places them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

from vgpu.core.claimconfig import DRIVER, MPS_CLASS
from vgpu.core.drarecord import claims_dir
from vgpu.core.gpumode import GPU_MODE_LABEL as MODE_LABEL
from vgpu.dra.cdi import spec_path
from vgpu.dra.migslices import MIG_CLASS, MIG_SELECTOR, MPS_SELECTOR, SHARED_SELECTOR
from vgpu_sandbox import procs, product
from vgpu_sandbox.errors import SandboxError
from vgpu_sandbox.runtime import Handle, Spec

COMPONENT = "dra-plugin-real-node"
CDI_DIR = Path("/var/run/cdi")


def _device_class(name: str, selector: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": selector}}]},
    }


# The DeviceClasses as the chart makes them (charts/vgpu/templates/dra-deviceclass.yaml): shares of
# time-sliced cards, shares of a card shared through MPS (docs/dra.md#mps-shares), a MIG slice
# (docs/mig.md#mig-with-dra: dra-plugin --mig dynamic).
DEVICE_CLASS = _device_class(DRIVER, SHARED_SELECTOR)
MPS_DEVICE_CLASS = _device_class(MPS_CLASS, MPS_SELECTOR)
MIG_DEVICE_CLASS = _device_class(MIG_CLASS, MIG_SELECTOR)


# ``--mig``: the first of the stub driver's cards as the fake NVML's H100 80GB in MIG mode, with
# no GPU instance (the plugin makes them as claims are prepared).
MIG_CARD: dict[str, Any] = {
    "model": "NVIDIA H100 80GB HBM3",
    "memoryMiB": 81559,
    "mig": {"mode": "enabled", "instances": []},
}


def state_dir(node_root: Path) -> Path:
    """The plugin's ``--state-dir``: grants, region folders, hook versions, checkpoint, records."""
    return node_root / "vgpu-dra"


def argv(
    sandbox: Handle, spec: Spec, node: str, node_root: Path, kubelet_root: Path, gpus_file: Path
) -> list[str]:
    """``vgpu dra-plugin`` for the real node; writes its node config into ``node_root``."""
    hook = product.hook_library()
    if hook is None:
        raise SandboxError("native/hook/build/libvgpu.so is not built: run `make native`")
    config: dict[str, Any] = {"split": spec.split}
    if spec.real_gpu:
        config["driverInject"] = "plugin"  # no NVIDIA container toolkit on the sandbox's runc
    config_file = node_root / "dra-node-config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    return [
        sys.executable,
        "-m",
        "vgpu.commands.cli",
        "dra-plugin",
        f"--node-name={node}",
        f"--kubeconfig={sandbox.kubeconfig}",
        f"--plugin-dir={kubelet_root / 'plugins' / DRIVER}",
        f"--registry-dir={kubelet_root / 'plugins_registry'}",
        f"--cdi-dir={CDI_DIR}",
        f"--state-dir={state_dir(node_root)}",
        f"--config={config_file}",
        f"--hook-library={hook}",
        "--slice-interval=2",
        *(["--mig=dynamic"] if spec.mig == "dynamic" else []),
        *([] if spec.real_gpu else [f"--fake-nvml={gpus_file}"]),
    ]


def start_plugin(
    sandbox: Handle, spec: Spec, node: str, node_root: Path, kubelet_root: Path, gpus_file: Path
) -> None:
    """Label the node, make the DeviceClass, start the plugin; returns once the node's slice is there."""
    sandbox.kubectl("label", "node", node, f"{MODE_LABEL}=dra", "--overwrite")
    sandbox.kubectl("apply", "-f", "-", input=json.dumps(DEVICE_CLASS))
    sandbox.kubectl("apply", "-f", "-", input=json.dumps(MIG_DEVICE_CLASS))
    sandbox.kubectl("apply", "-f", "-", input=json.dumps(MPS_DEVICE_CLASS))
    sandbox.launch(COMPONENT, argv(sandbox, spec, node, node_root, kubelet_root, gpus_file))

    def published() -> bool:
        slices = sandbox.api_get("/apis/resource.k8s.io/v1/resourceslices").get("items", [])
        return any(
            s["spec"].get("nodeName") == node
            and s["spec"].get("driver") == DRIVER
            and s["spec"].get("devices")
            for s in slices
        )

    what = "real NVML" if spec.real_gpu else "fake NVML"
    sandbox.wait_for(
        f"the DRA plugin to publish {node}'s ResourceSlice ({what})", published, 90, [COMPONENT, "kubelet"]
    )


def forget_specs(node_root: Path, cdi_dir: Path = CDI_DIR) -> list[Path]:
    """The CDI specs of the claims the node still had prepared (the kubelet gone before it
    unprepared them): removed from the machine's CDI folder, which outlives the node."""
    removed = []
    for record in sorted(claims_dir(state_dir(node_root)).glob("*.json")):
        path = spec_path(cdi_dir, record.stem)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


def kill_and_restart(sandbox: Handle) -> None:
    """SIGKILL the DRA plugin (no clean-up at all, as a crash) and start it again with the same
    command line; returns once it serves its socket again."""
    state = sandbox.state()
    if state is None:
        raise SandboxError(f"no sandbox in {sandbox.state_dir}")
    found = [c for c in state.components if c.name == COMPONENT]
    if not found:
        raise SandboxError(
            "this sandbox runs no DRA plugin: start it with `vgpu sandbox up --real-node --dra`"
        )
    old = found[-1]
    with contextlib.suppress(ProcessLookupError):
        os.kill(old.pid, signal.SIGKILL)
    # not watched as a component: its exit is what is waited for (a watched exit fails the wait)
    sandbox.wait_for("the killed DRA plugin to exit", lambda: not procs.alive(old.pid), 30)
    sandbox.adopt(state)
    state.components.remove(old)
    sandbox.launch(COMPONENT, old.argv, old.port)
