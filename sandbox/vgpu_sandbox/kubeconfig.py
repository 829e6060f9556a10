"""Kubeconfig files for the sandbox's identities (token authentication over TLS)."""

from __future__ import annotations

import base64
import json
from pathlib import Path


def write(path: Path, *, server: str, ca_pem: bytes, user: str, token: str) -> Path:
    """A kubeconfig with one cluster, one user and one context; YAML is a superset of JSON."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "vgpu-sandbox",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca_pem).decode(),
                },
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "vgpu-sandbox", "context": {"cluster": "vgpu-sandbox", "user": user}}],
        "current-context": "vgpu-sandbox",
    }
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path
