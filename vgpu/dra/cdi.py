"""The CDI spec of a prepared claim: what the container runtime adds to each container using it.

One spec file per claim in ``--cdi-dir`` (``vgpu.openaios.io-claim_<claim-uid>.json``), kind
``vgpu.openaios.io/claim``, one CDI device per request of the claim
(``<claim-uid>-<request>``) whose container edits are what the device plugin's Allocate gives a
container (contract 4): the environment, the region folder, the grant read-only at
``/etc/vgpu/limits``, the hook and ``/etc/ld.so.preload``, and under ``driverInject: plugin``
the driver's device nodes and files. The kubelet hands the runtime the device IDs
(``vgpu.openaios.io/claim=<name>``) the plugin returns from NodePrepareResources.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vgpu.core.claimconfig import DRIVER
from vgpu.hookabi.files import write_atomic

CDI_VERSION = "0.6.0"
VENDOR = DRIVER  # the CDI vendor is the driver's name
CLASS = "claim"
KIND = f"{VENDOR}/{CLASS}"


def safe(request: str) -> str:
    """A request's name in a file or CDI name: ``req/sub`` (a subrequest) as ``req.sub``."""
    return request.replace("/", ".")


def device_name(claim_uid: str, request: str) -> str:
    return f"{claim_uid}-{safe(request)}"


def device_id(claim_uid: str, request: str) -> str:
    """The fully qualified CDI device ID the kubelet passes to the runtime."""
    return f"{KIND}={device_name(claim_uid, request)}"


def spec_path(cdi_dir: Path, claim_uid: str) -> Path:
    return cdi_dir / f"{VENDOR}-{CLASS}_{claim_uid}.json"


@dataclass(frozen=True)
class Edits:
    """One CDI device's container edits."""

    env: Mapping[str, str]
    mounts: Sequence[tuple[str, str, bool]]  # (container path, host path, read-only)
    device_nodes: Sequence[str] = field(default_factory=tuple)  # /dev/... in the container and on the host

    def as_cdi(self) -> dict[str, Any]:
        edits: dict[str, Any] = {
            "env": [f"{k}={v}" for k, v in self.env.items()],
            "mounts": [
                {
                    "hostPath": host,
                    "containerPath": inside,
                    "options": ["ro" if read_only else "rw", "nosuid", "nodev", "bind"],
                }
                for inside, host, read_only in self.mounts
            ],
        }
        if self.device_nodes:
            edits["deviceNodes"] = [{"path": p, "permissions": "rw"} for p in self.device_nodes]
        return edits


def spec(claim_uid: str, devices: Mapping[str, Edits]) -> dict[str, Any]:
    """The claim's spec: ``devices`` maps each request name to its edits."""
    return {
        "cdiVersion": CDI_VERSION,
        "kind": KIND,
        "devices": [
            {"name": device_name(claim_uid, request), "containerEdits": edits.as_cdi()}
            for request, edits in devices.items()
        ],
    }


def write_json(path: Path, doc: Any, mode: int = 0o644) -> None:
    """``path`` holds ``doc`` as JSON, whole or not at all: a temporary file in the same folder,
    flushed to disk, renamed over it (a reader, or a plugin killed half way, never sees half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n", mode)
