"""The real node's NVIDIA container runtime, as a GPU node runs it (docs/security.md, "Cards only
through the plugin").

``nvidia-container-runtime`` is built from NVIDIA's Go modules beside nvidia-ctk (``tools/build.sh
nvidia-ctk``) and made containerd's default runtime by roles/gpu_node, as on any GPU node. The
node has no driver and so no libnvidia-container, so the toolkit runs in its CDI mode: it turns a
container's device list (its ``NVIDIA_VISIBLE_DEVICES`` where its config accepts that, volume
mounts under /var/run/nvidia-container-devices/cdi/, ``cdi.k8s.io/`` annotations) into devices of
the node's CDI spec. The stub driver's cards are that spec here (:func:`write_stub_spec`): each
card, by UUID, and ``all`` mount a marker file per card at :data:`CARDS_IN_CONTAINER`, so a
container lists the cards it got. The toolkit reads its config from ``$XDG_CONFIG_HOME``, which
containerd is started with (:func:`containerd_env`) and hands its shims, so nothing under /etc changes.

The chart's device plugin mounts each container's tmpfs folder under /var/lib/vgpu with
Bidirectional propagation, which needs the host path on a shared mount, as systemd makes / on a
real node; this machine's / may be private, so /var/lib/vgpu is bound on itself and made shared
(:func:`share_state_dir`) and unbound at ``down``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from vgpu_sandbox import binaries
from vgpu_sandbox.errors import SandboxError

RUNTIME = "nvidia-container-runtime"
CDI_KIND = "nvidia.com/gpu"
STUB_SPEC = Path("/var/run/cdi/vgpu-sandbox-stub-gpus.json")
CARDS_IN_CONTAINER = "/run/vgpu-stub/cards"
STATE_DIR = Path("/var/lib/vgpu")


def runtime_binary() -> Path:
    return binaries.bin_dir() / RUNTIME


def xdg_dir(root: Path) -> Path:
    return root / "xdg"


def toolkit_config(root: Path) -> Path:
    """The toolkit's config.toml, where nvidia-container-runtime looks with ``XDG_CONFIG_HOME``."""
    return xdg_dir(root) / "nvidia-container-runtime" / "config.toml"


def containerd_env(root: Path) -> list[str]:
    """``env`` and its assignments, to put before containerd's argv: its shims and the runtime
    they start inherit them (a restart reuses the argv, so the environment goes with it)."""
    return ["env", f"XDG_CONFIG_HOME={xdg_dir(root)}"]


def role_vars(root: Path) -> dict[str, Any]:
    """What roles/gpu_node is told on the real node: the built runtime as containerd's default,
    its config where containerd's environment points, in CDI mode."""
    return {
        "gpu_node_nvidia_runtime_path": str(runtime_binary()),
        "gpu_node_nvidia_runtime_default": True,
        "gpu_node_nvidia_runtime_config": str(toolkit_config(root)),
        "gpu_node_nvidia_runtime_settings": {"nvidia-container-runtime.mode": "cdi"},
    }


def write_stub_spec(root: Path, uuids: list[str]) -> None:
    """The stub driver's cards as a CDI spec of kind nvidia.com/gpu: each by UUID, and ``all``."""
    markers = root / "stub-cards"
    markers.mkdir(exist_ok=True)
    mounts = {}
    for uuid in uuids:
        marker = markers / uuid
        marker.write_text(uuid + "\n")
        marker.chmod(0o444)
        mounts[uuid] = {
            "hostPath": str(marker),
            "containerPath": f"{CARDS_IN_CONTAINER}/{uuid}",
            "options": ["ro", "bind"],
        }
    devices = [{"name": u, "containerEdits": {"mounts": [m]}} for u, m in mounts.items()]
    devices.append({"name": "all", "containerEdits": {"mounts": list(mounts.values())}})
    STUB_SPEC.parent.mkdir(parents=True, exist_ok=True)
    STUB_SPEC.write_text(json.dumps({"cdiVersion": "0.5.0", "kind": CDI_KIND, "devices": devices}, indent=2))


def remove_stub_spec() -> None:
    STUB_SPEC.unlink(missing_ok=True)


def _shared(path: Path) -> bool:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(path):
            return any(f.startswith("shared:") for f in fields[6 : fields.index("-")])
    return False


def share_state_dir() -> bool:
    """Make /var/lib/vgpu a shared mount (bound on itself) unless it is one; True when it did."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    if _shared(STATE_DIR):
        return False
    for step in (
        ["mount", "--bind", str(STATE_DIR), str(STATE_DIR)],
        ["mount", "--make-rshared", str(STATE_DIR)],
    ):
        done = subprocess.run(step, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise SandboxError(f"{' '.join(step)} failed: {done.stderr.strip()}")
    return True
