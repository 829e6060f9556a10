"""What the chart's offline tests share: the real helm and kube-scheduler from `make setup`
($VGPU_BIN_DIR/current/), and readers of rendered objects."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml
from vgpu_sandbox import binaries

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "vgpu"
SCENARIOS = sorted(CHART.glob("ci/*-values.yaml"))
KUBE_VERSION = "1.33.0"
NS = "kube-system"


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binaries.find("helm")), *args], capture_output=True, text=True, timeout=120, check=False
    )


def template(*args: str, kube_version: str = KUBE_VERSION) -> subprocess.CompletedProcess[str]:
    """`helm template vgpu charts/vgpu -n kube-system --kube-version V ARGS`, successful or not."""
    return helm("template", "vgpu", str(CHART), "-n", NS, "--kube-version", kube_version, *args)


def render(*args: str, kube_version: str = KUBE_VERSION) -> list[dict[str, Any]]:
    """The rendered objects; fails the test when helm refuses."""
    result = template(*args, kube_version=kube_version)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {[o['metadata']['name'] for o in objs]}"
    return matches[0]


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod_spec["containers"] if c["name"] == name)


def scenario_id(path: Path) -> str:
    return path.name.removesuffix("-values.yaml")


def kube_scheduler_checks(config: Path, flags: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    """The real kube-scheduler decoding (strictly) and validating CONFIG with FLAGS, then exiting:
    --write-config-to stops it before it connects; --master only lets it build a client."""
    return subprocess.run(
        [str(binaries.find("kube-scheduler")), f"--config={config}", *flags]
        + [f"--write-config-to={tmp / 'written.yaml'}", "--master=https://127.0.0.1:1", f"--cert-dir={tmp}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
