"""Where the sandbox finds the control-plane binaries that ``tools/build.sh`` builds."""

from __future__ import annotations

import os
from pathlib import Path

from vgpu_sandbox.errors import SandboxError

CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok")


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def bin_dir() -> Path:
    """``$VGPU_BIN_DIR/current`` (default ``<repo>/.cache/bin/current``), as ``make setup`` fills it."""
    base = os.environ.get("VGPU_BIN_DIR")
    return (Path(base) if base else repo_root() / ".cache" / "bin") / "current"


def find(name: str) -> Path:
    path = bin_dir() / name
    if not (path.exists() and os.access(path, os.X_OK)):
        raise SandboxError(
            f"{name} is missing: expected an executable at {path}. "
            f"Run `make setup` (or `bash tools/build.sh`) to build it, "
            f"or point VGPU_BIN_DIR at the cache that holds it."
        )
    return path


def check_all(names: tuple[str, ...] = CONTROL_PLANE) -> dict[str, Path]:
    """Every binary the control plane needs, or one error naming all that are missing."""
    found: dict[str, Path] = {}
    missing: list[str] = []
    for name in names:
        try:
            found[name] = find(name)
        except SandboxError:
            missing.append(name)
    if missing:
        raise SandboxError(
            f"missing binaries: {', '.join(missing)} (looked in {bin_dir()}). "
            f"Run `make setup` to build them, or set VGPU_BIN_DIR to the cache that holds them."
        )
    return found
