"""What the e2e tests need to run a component on the chart's own command line, here."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from vgpu_sandbox.procs import free_port


def local_extender_flags(command: Sequence[str], cert: Path, key: Path, ca: Path) -> tuple[int, list[str]]:
    """The chart's extender command (``vgpu extender --flag=value ...``), its flags with what the
    pod's network and Secret mounts give it made local: a free port to serve on (returned with
    the flags), another for metrics, and these certificate files (``ca``: the CA whose client
    certificates may call the scheduling verbs)."""
    assert list(command[:2]) == ["vgpu", "extender"], command
    port = free_port()
    local = {
        "--listen": f"127.0.0.1:{port}",
        "--metrics-listen": f"127.0.0.1:{free_port()}",
        "--cert-file": str(cert),
        "--key-file": str(key),
        "--client-ca-file": str(ca),
    }
    return port, [f"{k}={local.get(k, v)}" for k, v in (a.split("=", 1) for a in command[2:])]
